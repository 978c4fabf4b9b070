"""convert and export stream: a model's tensors are read, renamed and written a layer at a time
(formats/checkpoint_writer.py, model_tensors.py), never a whole model in memory. What they write is a safetensors
file safetensors' own reader takes, holding what the whole-model path gives: `convert --quantize` equals `manas
quantize` of the float conversion, and a quantized checkpoint exports its dequantized model, tensor for tensor.
Their peak memory does not grow with the model's layers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_fixtures import cli_env
from manas_cli.formats import llama
from manas_cli.formats.checkpoint import load_checkpoint, stored_state
from manas_cli.formats.convert import convert_checkpoint
from manas_cli.formats.hf_export import export_hf
from manas_cli.torch_engine.quantize import dequantize_model, quantize_model
from test_llama_family import hf_folder

FAMILIES = ("smollm2", "tinyllama", "phi4-mini", "gemma3")  # tied, untied, fused projections, 1 + w norms


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as safetensors' own reader gives it (it refuses holes, overlaps and
    misplaced data)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_bpe_spec) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("streamed")
    for family in FAMILIES:
        hf_folder(root / family, tiny_bpe_spec, family, shard=family == "tinyllama")
    return {family: root / family for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_streamed_file_is_safetensors_with_its_data_aligned_and_holds_the_loaded_model(folders, tmp_path, family):
    out = tmp_path / "model.safetensors"
    convert_checkpoint(folders[family], out)
    tensors = file_tensors(out)
    length = int.from_bytes(out.read_bytes()[:8], "little")
    header = json.loads(out.read_bytes()[8 : 8 + length])
    assert (8 + length) % 8 == 0
    assert all(entry["dtype"] == "F32" for name, entry in header.items() if name != "__metadata__")
    model = load_checkpoint(out).model
    expected = stored_state(model, None)
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], expected[name]) for name in tensors)


def test_a_bfloat16_folder_converts_to_its_values_in_float32(folders, tmp_path):
    """Hugging Face's usual dtype: each tensor cast a slice of rows at a time, exactly (bfloat16 is a float32
    with its low 16 bits zero)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(folders["smollm2"], folder)
    weights = load_file(folder / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in weights.items()}, folder / "model.safetensors")
    convert_checkpoint(folder, tmp_path / "from-bf16.safetensors")
    convert_checkpoint(folders["smollm2"], tmp_path / "from-f32.safetensors")
    rounded, exact = file_tensors(tmp_path / "from-bf16.safetensors"), file_tensors(tmp_path / "from-f32.safetensors")
    assert rounded.keys() == exact.keys()
    for name, tensor in rounded.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, exact[name].to(torch.bfloat16).float()), name


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("family", ["smollm2", "tinyllama"])
def test_convert_quantize_writes_what_manas_quantize_makes_of_the_float_file(folders, tmp_path, family, kind):
    """The same rounding, the same scales, a tied output layer stored in the embedding's place, and the same
    metadata but for where the file came from."""
    float_file, quantized_file = tmp_path / "float.safetensors", tmp_path / f"{kind}.safetensors"
    convert_checkpoint(folders[family], float_file)
    convert_checkpoint(folders[family], quantized_file, quantize=kind)
    model = quantize_model(load_checkpoint(float_file).model, kind)
    expected = {name: t.contiguous() for name, t in stored_state(model, kind).items()}
    tensors = file_tensors(quantized_file)
    assert tensors.keys() == expected.keys()
    for name, tensor in tensors.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    loaded = load_checkpoint(quantized_file)
    assert loaded.metadata["quantization"] == kind and loaded.model.config == model.config


# Runs the CLI and, at its exit, writes the process's peak resident memory (VmHWM, KiB) where PEAK_FILE says. Not
# ru_maxrss: that carries the parent's high-water mark across fork and exec, and the parent here is pytest.
PEAK_REPORTING_MAIN = """
import atexit, os, runpy, sys
def report():
    peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    open(os.environ["PEAK_FILE"], "w").write(peak.split()[1])
atexit.register(report)
sys.argv[0] = "manas"
runpy.run_module("manas_cli", run_name="__main__")
"""


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_checkpoint_exports_its_dequantized_model(folders, tmp_path, kind):
    checkpoint = tmp_path / f"{kind}.safetensors"
    convert_checkpoint(folders["tinyllama"], checkpoint, quantize=kind)
    export_hf(checkpoint, tmp_path / "hf")
    model = dequantize_model(load_checkpoint(checkpoint).model)
    expected = llama.hf_tensors(model.config, stored_state(model, None))
    tensors = file_tensors(tmp_path / "hf" / "model.safetensors")
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], expected[name]) for name in tensors)


def peak_memory_mib(tmp_path: Path, *args: str | Path) -> float:
    """The peak resident memory of one `manas` process, in MiB."""
    peak_file = tmp_path / "peak"
    result = subprocess.run(
        [sys.executable, "-c", PEAK_REPORTING_MAIN, *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(PEAK_FILE=str(peak_file)),
    )
    assert result.returncode == 0, result.stderr
    return int(peak_file.read_text()) / 1024


def test_peak_memory_does_not_grow_with_the_layers(tmp_path, tiny_bpe_spec):
    """16 more layers of 12 MiB (float32) each add 200 MiB to the weights and almost nothing to the peak of convert,
    export and export to GGUF: a whole-model conversion held the weights two or three times over."""
    shape = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4)
    peaks = []
    for layers in (2, 18):
        folder, checkpoint = tmp_path / f"hf-{layers}", tmp_path / f"{layers}.safetensors"
        hf_folder(folder, tiny_bpe_spec, "tinyllama", num_hidden_layers=layers, **shape)
        peaks.append(
            (
                peak_memory_mib(tmp_path, "convert", folder, "--out", checkpoint),
                peak_memory_mib(tmp_path, "export", checkpoint, "--out", tmp_path / f"export-{layers}"),
                peak_memory_mib(tmp_path, "export", checkpoint, "--format", "gguf", "--outtype", "f32", "--out",
                                tmp_path / f"{layers}.gguf"),
            )
        )  # fmt: skip
        assert checkpoint.stat().st_size > layers * 12 << 20
    assert all(more - fewer < 64 for fewer, more in zip(*peaks)), peaks


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path, tiny_bpe_spec):
    """Sharded weights whose index places a tensor in one shard while another holds it too: read as either, the
    model would be whichever came last."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    hf_folder(folder, tiny_bpe_spec, "smollm2", shard=True)
    first, second = sorted(folder.glob("model-*.safetensors"))[:2]
    extra = load_file(first)
    name = next(iter(extra))
    save_file({**load_file(second), name: extra[name]}, second)
    result = subprocess.run(
        [sys.executable, "-m", "manas_cli", "convert", folder, "--out", tmp_path / "out.safetensors"],
        capture_output=True, text=True, env=cli_env(),
    )  # fmt: skip
    assert result.returncode == 1 and f"holds {name}, which {first.name} holds too" in result.stderr, result.stderr
    assert not (tmp_path / "out.safetensors").exists()
