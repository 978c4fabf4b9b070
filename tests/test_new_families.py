"""The small models of 2025–26 that are a Llama-family decoder with one idea more (issue 71): Qwen3 (each query and
key head RMS-normed before rope), Llama 3.1 and 3.2 (a scaled rope, rope_type "llama3") and SmolLM3 (no rope on
every fourth layer). Random models of each, as transformers builds them, run from their Hugging Face folder and from
the GGUF file manas exports in llama.cpp's layout (`qwen3` with attn_q_norm/attn_k_norm, `llama` with rope_freqs,
`smollm3`): greedy text and scores are transformers' on both engines, cached generation equals crop-and-recompute
past the window, exports go back to transformers, and each bad field is one error line."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from cli_fixtures import RUN_OPTIONS, manas
from conftest import needs_compiler
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.formats.tokenizer import encode_text
from test_llama_family import CTX, LLAMA3_ROPE, PROMPT, converted, crop_and_recompute, hf_folder
from test_real_models import copy_fields

gguf = pytest.importorskip("gguf")

NEW = ("qwen3", "llama3.2", "llama3-scaled", "smollm3", "gemma3", "phi4-mini")
TEXT = "the theatre in the city, and then the weather: 12 émigrés in 2025. " * 3


@pytest.fixture(scope="module")
def new_models(tmp_path_factory, tiny_bpe_spec) -> dict[str, dict]:
    """Per family: transformers' model, its folder converted, and that checkpoint exported as an f32 GGUF."""
    models = {}
    for family in NEW:
        folder = tmp_path_factory.mktemp(family)
        hf = hf_folder(folder / "hf", tiny_bpe_spec, family)
        checkpoint = converted(folder, folder / "hf")
        exported = folder / "model.gguf"
        manas("export", checkpoint, "--format", "gguf", "--outtype", "f32", "--out", exported).ok()
        models[family] = {"hf": hf, "checkpoint": checkpoint, "gguf": exported}
    return models


def transformers_greedy(hf, ids: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


@needs_compiler
@pytest.mark.parametrize("engine", ["native", "torch"])
@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
@pytest.mark.parametrize("family", NEW)
def test_greedy_text_is_transformers_for_64_tokens_on_both_engines(new_models, family, source, engine):
    model = new_models[family]
    env = {} if engine == "native" else {"MANAS_ENGINE": "torch"}
    run = manas("generate", "-m", model[source], *RUN_OPTIONS, "-p", PROMPT, "-n", "64", "-t", "0", "--json", **env)
    record = run.ok().json()
    assert record["engine"] == engine
    if source == "gguf" and engine == "native":
        assert record["weights"].startswith("GGUF")  # run in place
    ids = encode_text(load_checkpoint(model["checkpoint"]).encoding, PROMPT)
    expected = transformers_greedy(model["hf"], ids, 64)
    assert record["tokens"] == expected[: len(record["tokens"])] and len(record["tokens"]) >= 32


@needs_compiler
@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
@pytest.mark.parametrize("family", ["qwen3", "llama3-scaled", "smollm3", "gemma3", "phi4-mini"])
def test_a_score_is_transformers_within_1e_4_nats_per_token(new_models, family, source, tmp_path):
    model = new_models[family]
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    record = manas("score", str(text), "-m", model[source], *RUN_OPTIONS, "--json").ok().json()
    ids = encode_text(load_checkpoint(model["checkpoint"]).encoding, TEXT)
    assert record["tokens"] == len(ids) - 1
    with torch.no_grad():
        expected = model["hf"](torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert abs(record["nats_per_token"] - expected) <= 1e-4


@needs_compiler
@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
@pytest.mark.parametrize("family", ["qwen3", "llama3-scaled", "smollm3", "gemma3", "phi4-mini"])
def test_seeded_generation_past_the_window_equals_crop_and_recompute(new_models, family, source):
    path = new_models[family][source]
    run = manas("generate", "-m", path, *RUN_OPTIONS, "-p", PROMPT, "-n", "40", "--ctx", str(CTX), "-t", "0.9",
                "--top-k", "40", "--seed", "7", "--json")  # fmt: skip
    record = run.ok().json()
    assert record["engine"] == "native" and record["re_prefills"] > 0
    assert record["tokens"] == crop_and_recompute(path, "native", PROMPT, 40, 7, temperature=0.9, top_k=40)


def test_the_gguf_holds_llama_cpps_tensors_for_each_family(new_models):
    """qwen3 keeps Hugging Face's rotate-half layout and its head norms as they are; a scaled rope's factors are
    llama's rope_freqs.weight, float32, one per rope pair."""
    reader = gguf.GGUFReader(new_models["qwen3"]["gguf"])
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "qwen3"
    q_norm = new_models["qwen3"]["hf"].model.layers[1].self_attn.q_norm.weight.detach()
    assert torch.equal(torch.from_numpy(tensors["blk.1.attn_q_norm.weight"].data.copy()), q_norm)
    assert "rope_freqs.weight" not in tensors
    for family in ("llama3.2", "llama3-scaled"):
        reader = gguf.GGUFReader(new_models[family]["gguf"])
        factors = {t.name: t for t in reader.tensors}["rope_freqs.weight"].data.tolist()
        assert factors == load_checkpoint(new_models[family]["checkpoint"]).model.config.rope_factors
        assert reader.fields["general.architecture"].contents() == "llama"
    reader = gguf.GGUFReader(new_models["smollm3"]["gguf"])  # llama.cpp's every fourth layer without rope, implied
    assert reader.fields["general.architecture"].contents() == "smollm3"
    assert "rope_freqs.weight" not in {t.name for t in reader.tensors}


@pytest.mark.parametrize("family", ["qwen3", "llama3.2", "smollm3", "gemma3", "phi4-mini"])
def test_export_hf_gives_transformers_the_same_model(new_models, family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = new_models[family]
    manas("export", model["checkpoint"], "--format", "hf", "--out", tmp_path / "back").ok()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(model["hf"])
    ids = torch.randint(0, 270, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model["hf"](ids).logits, atol=1e-4, rtol=0)


def test_rope_factors_hugging_face_cannot_name_are_refused_by_export_hf_but_not_gguf(new_models, tmp_path):
    run = manas("export", new_models["llama3-scaled"]["checkpoint"], "--format", "hf", "--out", tmp_path / "back")
    assert run.returncode != 0 and run.err.startswith("error: ") and "--format gguf" in run.err
    assert not (tmp_path / "back").exists()


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def assert_convert_refuses(tmp_path: Path, spec: dict, family: str, changes: dict, message: str) -> None:
    """The family's folder with its config.json changed: `manas convert` refuses it with one error line naming
    `message`, and writes nothing."""
    hf_folder(tmp_path / "hf", spec, family)
    edit_config(tmp_path / "hf", **changes)
    run = manas("convert", tmp_path / "hf", "--out", tmp_path / "out.safetensors")
    assert run.returncode != 0 and run.err.startswith("error: ") and message in run.err, run.err
    assert len(run.err.strip().splitlines()) == 1 and not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "low_freq_factor"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": -1.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "rope_scaling.factor",
        ),  # fmt: skip
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1.0}}, "rope_scaling.beta"),
        ({"rope_scaling": "llama3"}, "rope_scaling must be an object"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 1e300}}, "rope_factors must be positive finite"),
        ({"rope_theta": -1.0, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": -1.0}}, "rope_base"),
    ],
)
def test_a_bad_rope_scaling_is_one_error_line_naming_the_field(tmp_path, tiny_bpe_spec, changes, message):
    assert_convert_refuses(tmp_path, tiny_bpe_spec, "llama3.2", changes, message)


@pytest.mark.parametrize("factors, message", [([1.0] * 3, "one factor per rope pair"), ([-1.0] * 8, "positive")])
def test_a_gguf_whose_rope_freqs_do_not_fit_is_one_error_line(new_models, tmp_path, factors, message):
    source = gguf.GGUFReader(new_models["llama3.2"]["gguf"])
    out = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(out, "llama")
    copy_fields(writer, source.fields)
    for tensor in source.tensors:
        data = tensor.data.copy().reshape(tuple(int(n) for n in reversed(tensor.shape)))
        writer.add_tensor(tensor.name, data if tensor.name != "rope_freqs.weight" else torch.tensor(factors).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for env in ({}, {"MANAS_ENGINE": "torch"}):
        run = manas("generate", "-m", out, *RUN_OPTIONS, "-p", "the", "-n", "2", **env)
        assert run.returncode != 0 and run.err.startswith("error: ") and message in run.err, run.err
        assert "Traceback" not in run.err


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"no_rope_layers": [1, 1, 0]}, "one 0 (no rope) or 1 (rope) per layer, 4"),
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers must hold"),
        ({"no_rope_layers": "every fourth"}, "no_rope_layers must hold"),
        ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive"),
        ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
    ],
)
def test_a_bad_no_rope_layers_is_one_error_line_naming_the_field(tmp_path, tiny_bpe_spec, changes, message):
    assert_convert_refuses(tmp_path, tiny_bpe_spec, "smollm3", changes, message)


def test_layers_without_rope_other_than_every_fourth_export_to_hf_but_not_to_gguf(tmp_path, tiny_bpe_spec):
    """llama.cpp's smollm3 leaves out every fourth layer's rope, whatever the file says; transformers reads the list."""
    from transformers import AutoModelForCausalLM

    hf = hf_folder(tmp_path / "hf", tiny_bpe_spec, "smollm3", no_rope_layers=[0, 1, 1, 1])
    checkpoint = converted(tmp_path, tmp_path / "hf")
    assert load_checkpoint(checkpoint).model.config.nope_layers == [0]
    run = manas("export", checkpoint, "--format", "gguf", "--out", tmp_path / "model.gguf")
    assert run.returncode != 0 and "every fourth layer, not of layers 0" in run.err, run.err
    assert not (tmp_path / "model.gguf").exists()
    manas("export", checkpoint, "--format", "hf", "--out", tmp_path / "back").ok()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 270, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


@needs_compiler
@pytest.mark.parametrize("engine", ["native", "torch"])
def test_inspect_cache_shows_each_layers_window_and_the_bytes_it_attends_over(new_models, engine):
    """Gemma 3's local layers (two of three here, a window of 8) attend over their last 8 positions of what the
    cache holds; the global layer over all of it."""
    env = {} if engine == "native" else {"MANAS_ENGINE": "torch"}
    run = manas("inspect-cache", "-m", new_models["gemma3"]["checkpoint"], *RUN_OPTIONS, "-p", PROMPT, "--tokens",
                "30", "--json", **env)  # fmt: skip
    report = run.ok().json()
    positions, layers = report["positions"], report["layers"]
    assert positions > 8 and [layer["window"] for layer in layers] == [8, 8, None]
    for layer in layers:
        per_position = layer["bytes"] // positions
        assert layer["window_bytes"] == per_position * (8 if layer["window"] else positions)
    assert report["window_bytes"] == sum(layer["window_bytes"] for layer in layers) < report["logical_bytes"]
    shown = manas("inspect-cache", "-m", new_models["gemma3"]["checkpoint"], *RUN_OPTIONS, "-p", PROMPT, "--tokens",
                  "30", **env).ok().out  # fmt: skip
    assert "in window" in shown and "sliding windows: the layers attend over" in shown


LLAMA_CPP_BIN = Path(os.environ.get("MANAS_LLAMA_CPP_BIN", Path.home() / ".cache/manas-llamacpp/build/bin"))


@needs_compiler
@pytest.mark.parametrize("family", NEW)
def test_llama_cpp_greedy_text_on_the_exported_gguf_is_manas_generate(new_models, family):
    """llama.cpp's own forward of each family, as its `llama-simple` (greedy) runs manas' GGUF export (built by
    the project's build-llamacpp.sh tool; MANAS_LLAMA_CPP_BIN names another folder): the same greedy text.
    (llama-completion may lose its last printed bytes as it exits, on a busy machine; llama-simple prints with
    printf.)"""
    assert_llama_simple_writes_manas_text(new_models[family])


def assert_llama_simple_writes_manas_text(model: dict) -> None:
    """llama-simple's greedy text on model["gguf"] is `manas generate -t 0`'s, byte for byte."""
    simple = LLAMA_CPP_BIN / "llama-simple"
    if not simple.is_file():
        pytest.skip(f"no llama-simple in {LLAMA_CPP_BIN} (the project's build-llamacpp.sh tool builds it)")
    record = manas("generate", "-m", model["gguf"], *RUN_OPTIONS, "-p", PROMPT, "-n", "32", "-t", "0", "--json").ok()
    run = subprocess.run([simple, "-m", model["gguf"], "-n", "32", PROMPT], capture_output=True, timeout=120,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:].decode(errors="replace")
    # a random model writes bytes that are no UTF-8 of their own: compared as bytes, llama.cpp's printed as they come
    # after the prompt's (a NUL byte's token prints nothing, as a C string), manas' each token's
    encoding = load_checkpoint(model["checkpoint"]).encoding
    ours = b"".join(encoding.decode_single_token_bytes(token) for token in record.json()["tokens"])
    assert run.stdout.removeprefix(PROMPT.encode()).removesuffix(b"\n") == ours.replace(b"\0", b"")


@needs_compiler
def test_a_llama_gguf_whose_rope_scales_linearly_runs_in_place_as_its_conversion_and_llama_cpp_run_it(
    new_models, tmp_path
):
    """llama.cpp's converter writes a linear rope scaling (Llama 2's long-context fine-tunes) as rope.scaling.type
    and .factor, with no rope_freqs tensor: every pair's frequency divided by the factor, in place as converted."""
    import numpy as np

    source = gguf.GGUFReader(new_models["llama3.2"]["gguf"])
    path = tmp_path / "linear.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    copy_fields(writer, source.fields)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    for tensor in source.tensors:
        if tensor.name != "rope_freqs.weight":
            writer.add_tensor(tensor.name, np.array(tensor.data).reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = tmp_path / "converted.safetensors"
    manas("convert", path, "--out", checkpoint).ok()
    assert load_checkpoint(checkpoint).model.config.rope_factors == [4.0] * 8
    runs = [manas("generate", "-m", model, *RUN_OPTIONS, "-p", PROMPT, "-n", "32", "-t", "0", "--json").ok().json()
            for model in (path, checkpoint)]  # fmt: skip
    assert runs[0]["weights"].startswith("GGUF") and runs[0]["tokens"] == runs[1]["tokens"]
    assert_llama_simple_writes_manas_text({"gguf": path, "checkpoint": checkpoint})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.7,
                              "short_factor": [1.0] * 5, "long_factor": [1.0] * 5}}, "even count"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                              "short_factor": [1.0] * 5, "long_factor": [1.0] * 5}}, "short_factor must hold 6"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "type 'dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)  # fmt: skip
def test_a_bad_phi3_config_is_one_error_line_naming_the_field(tmp_path, tiny_bpe_spec, changes, message):
    assert_convert_refuses(tmp_path, tiny_bpe_spec, "phi4-mini", changes, message)


def test_a_longrope_model_runs_within_its_original_context(new_models):
    """Past its original context each implementation turns by the long factors its own way; manas keeps the
    original one (256 here, of 512), where all of them use the short factors."""
    config = load_checkpoint(new_models["phi4-mini"]["checkpoint"]).model.config
    assert config.block_size == 256 and config.rotary_dims == 12 and config.rope_factors[:2] == [1.0, 1.100000023841858]
    assert abs(config.rope_scale - (1 + math.log(2) / math.log(256)) ** 0.5) < 1e-12
