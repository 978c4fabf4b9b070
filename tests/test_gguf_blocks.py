"""A GGUF file run in place (issue 70): the native core multiplies each ggml type's blocks as the file stores them.
Each type's products are checked against a reference that takes the gguf package's dequantized blocks and the
activations quantized as docs/native.md defines; whole models of mixed types (a Q4_K_M-like mix, and every type
in turn) run from the file, cached generation equal to crop-and-recompute and a batched row equal to the row
alone; and transformers, loading the same Q8_0 file, writes the same greedy text as --float-activations."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
import torch

from cli_fixtures import RUN_OPTIONS, manas
from conftest import needs_compiler, step_logits
from test_real_models import copy_fields, retyped, stored_blocks

gguf = pytest.importorskip("gguf")

# Every type the core multiplies, by the gguf package's name; the block types among them by unit size.
LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
SUPER = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
FLOATS = ("F16", "BF16")
Q4_K_M_LIKE = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")  # llama-quantize's Q4_K_M mixes these


def quantized_activations(x: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """x (rows, n) quantized per unit of 32 or 256 values as the core does: d = max|x| / 127, q = round(x · 127 /
    max|x|) (to nearest, ties to even), in float32. (scales (rows, n / unit), codes (rows, n))."""
    blocks = x.reshape(x.shape[0], -1, unit).astype(np.float32)
    largest = np.abs(blocks).max(axis=2, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inverse)
    return (largest / np.float32(127))[..., 0], codes.reshape(x.shape)


def core_linear(data: np.ndarray, name: str, rows: int, columns: int):
    from manas_cli.native.binding import WEIGHTS_GGML, ManasLinear

    kind = int(gguf.GGMLQuantizationType[name])
    return ManasLinear(WEIGHTS_GGML, columns, rows, kind, data.ctypes.data, None, None, None)


def core_products(library, linear, x: np.ndarray, integer: bool) -> np.ndarray:
    rows, n = x.shape
    x = np.ascontiguousarray(x, np.float32)
    quantized = np.zeros(rows * library.manas_quantized_row_floats(n), np.float32)
    row, y = np.zeros(n, np.float32), np.zeros((rows, linear.n_out), np.float32)
    library.manas_ggml_products(ctypes.byref(linear), rows, x.ctypes.data, int(integer), quantized.ctypes.data,
                                row.ctypes.data, y.ctypes.data)  # fmt: skip
    return y


@needs_compiler
@pytest.mark.parametrize("name", [*LEGACY, *SUPER, *FLOATS])
def test_each_type_multiplies_its_dequantized_blocks_by_activations_quantized_per_unit(native_library, name):
    """The core's dequantized rows are the gguf package's, bit for bit; its integer products are Σ_units d ·
    Σ w·q over those values and the activations quantized per unit (32 values, 256 for the K-quants), to float
    rounding; with float activations, the float32 product of those values."""
    rng = np.random.default_rng(3)
    rows, columns = 12, 1024
    data = np.ascontiguousarray(stored_blocks(rng.standard_normal((rows, columns), np.float32), name, rng, 0.002))
    weights = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]).reshape(rows, columns)
    linear = core_linear(data, name, rows, columns)
    row = np.zeros(columns, np.float32)
    for o in (0, 5, rows - 1):
        native_library.manas_ggml_row(ctypes.byref(linear), o, row.ctypes.data)
        assert np.array_equal(row, weights[o]), (name, o)
    x = rng.standard_normal((7, columns), np.float32) * np.float32(4)  # a tile of 4 rows of x and 3 left over
    floats = core_products(native_library, linear, x, integer=False)
    exact = x.astype(np.float64) @ weights.T.astype(np.float64)
    assert np.abs(floats - exact).max() <= 1e-5 * (np.abs(x) @ np.abs(weights.T)).max(), name
    if name in FLOATS:
        return
    unit = 256 if name in SUPER else 32
    scales, codes = quantized_activations(x, unit)
    terms = (codes[:, None, :] * weights[None, :, :].astype(np.float64)).reshape(len(x), rows, -1, unit).sum(axis=3)
    reference = (terms * scales[:, None, :]).sum(axis=2)
    bound = (np.abs(terms) * scales[:, None, :]).sum(axis=2).max()
    got = core_products(native_library, linear, x, integer=True)
    assert np.abs(got - reference).max() <= 2e-6 * bound, name
    assert not np.array_equal(got, floats)  # the integer path is its own
    for r in range(len(x)):  # a prefill's rows (tiles of x) give each row's decode step, bit for bit
        assert np.array_equal(core_products(native_library, linear, x[r : r + 1], integer=True)[0], got[r]), (name, r)


@pytest.fixture(scope="module")
def typed_files(tmp_path_factory, tiny_bpe_spec) -> dict[str, object]:
    """SmolLM2- and Qwen2-shaped models 256 wide (a K-quant's superblock), exported as f32 GGUFs, then stored as a
    Q4_K_M-like mix and as every type in turn; with the f32 file and the HF folder of the SmolLM2 one."""
    from test_llama_family import converted, hf_folder

    folder = tmp_path_factory.mktemp("gguf-blocks")
    files = {}
    for family in ("smollm2", "qwen2"):
        hf_folder(folder / family, tiny_bpe_spec, family, hidden_size=256, intermediate_size=512, num_attention_heads=4)
        (folder / family / "manas").mkdir()
        checkpoint = converted(folder / family / "manas", folder / family)
        f32 = folder / f"{family}-f32.gguf"
        manas("export", checkpoint, "--format", "gguf", "--outtype", "f32", "--out", f32).ok()
        files[f"{family}-f32"], files[f"{family}-hf"] = f32, folder / family
        retyped(f32, folder / f"{family}-mix.gguf", Q4_K_M_LIKE, scale=0.002)
        retyped(f32, folder / f"{family}-all.gguf", (*SUPER, *LEGACY, *FLOATS), scale=0.002)
        files[f"{family}-mix"], files[f"{family}-all"] = folder / f"{family}-mix.gguf", folder / f"{family}-all.gguf"
    return files


@pytest.mark.parametrize("file", ["smollm2-all", "qwen2-mix"])
def test_convert_streams_the_tensors_the_whole_file_import_builds(typed_files, file, tmp_path):
    """`manas convert` reads a layer at a time; torch's engine imports the file whole: the same float32 tensors."""
    from safetensors import safe_open

    from manas_cli.formats.checkpoint import stored_state
    from manas_cli.formats.gguf_model import load_gguf_checkpoint

    out = tmp_path / "converted.safetensors"
    manas("convert", typed_files[file], "--out", out).ok()
    expected = stored_state(load_gguf_checkpoint(typed_files[file]).model, None)
    with safe_open(out, framework="pt") as f:
        assert set(f.keys()) == set(expected)
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), expected[name]), name


def test_a_gguf_exports_a_layer_at_a_time_the_model_its_conversion_exports(typed_files, tmp_path):
    from safetensors import safe_open

    path = typed_files["qwen2-mix"]
    manas("export", path, "--out", tmp_path / "direct").ok()
    manas("convert", path, "--out", tmp_path / "converted.safetensors").ok()
    manas("export", tmp_path / "converted.safetensors", "--out", tmp_path / "through").ok()
    with (
        safe_open(tmp_path / "direct" / "model.safetensors", "pt") as a,
        safe_open(tmp_path / "through" / "model.safetensors", "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(name), b.get_tensor(name)) for name in a.keys())
    assert (tmp_path / "direct" / "config.json").read_text() == (tmp_path / "through" / "config.json").read_text()


@needs_compiler
@pytest.mark.parametrize("file", ["smollm2-mix", "qwen2-mix", "smollm2-all", "qwen2-all"])
def test_a_gguf_runs_in_place_and_its_cached_generation_equals_crop_and_recompute(typed_files, file, tmp_path):
    from test_llama_family import CTX, PROMPT, crop_and_recompute

    path = typed_files[file]
    run = manas("generate", "-m", path, *RUN_OPTIONS, "-p", PROMPT, "-n", "40", "--ctx", str(CTX), "-t", "0.9",
                "--top-k", "40", "--seed", "7", "--json", XDG_CACHE_HOME=str(tmp_path / "cache")).ok()  # fmt: skip
    record = run.json()
    assert record["engine"] == "native" and record["re_prefills"] > 0 and record["weights"].startswith("GGUF")
    assert record["tokens"] == crop_and_recompute(path, "native", PROMPT, 40, 7, temperature=0.9, top_k=40)
    assert not (tmp_path / "cache" / "manas" / "gguf").exists()  # nothing converted, nothing copied


def test_an_open_gguf_keeps_no_copy_of_its_vocabulary_beside_the_file(typed_files, tmp_path, monkeypatch):
    """A run holds the file's bytes, its tensors' extents, config and tokenizer: not the metadata's token and merge
    strings, which are read only to build the tokenizer (8 MB of Python strings for SmolLM2's 49,152 tokens, held
    through the run, had put its peak memory 1.19x llama-completion's)."""
    import gc

    from manas_cli.formats.gguf_metadata import layout_of
    from manas_cli.formats.gguf_weights import open_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = typed_files["smollm2-mix"]
    tokens = layout_of(path.read_bytes(), path).fields["tokenizer.ggml.tokens"]
    assert len(tokens) > 100
    opened = open_gguf(path)
    seen, reachable, lists = set(), [opened], 0
    while reachable:  # everything the opened file refers to, as the garbage collector sees it
        item = reachable.pop()
        if id(item) in seen or isinstance(item, (bytes, bytearray, memoryview, str, type)):
            continue
        seen.add(id(item))
        lists += isinstance(item, list) and len(item) == len(tokens) and bool(item) and isinstance(item[0], str)
        reachable.extend(gc.get_referents(item))
    assert len(seen) > 20 and lists == 0


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_a_gguf_models_rows_decoded_together_equal_each_row_alone(typed_files, native_library, threads):
    from manas_cli.formats.gguf_weights import GGUFWeights, open_gguf
    from manas_cli.native.model import NativeGPT
    from manas_cli.native.session import NativeSession, decode_rows

    opened = open_gguf(typed_files["qwen2-mix"])
    together_model = NativeGPT(GGUFWeights(opened, native_library), native_library, threads)
    alone_model = NativeGPT(GGUFWeights(opened, native_library), native_library, 1)
    prompts = [torch.randint(0, 260, (1, n), generator=torch.Generator().manual_seed(n)) for n in (2, 7, 12)]
    together = [NativeSession(together_model) for _ in prompts]
    alone = [NativeSession(alone_model) for _ in prompts]
    for session, solo, prompt in zip(together, alone, prompts):
        assert torch.equal(step_logits(session.prefill(prompt)), step_logits(solo.prefill(prompt)))
    nexts = [11, 42, 250]
    logits = step_logits(decode_rows(together_model, nexts, together))
    for row, solo in enumerate(alone):
        assert torch.equal(logits[row], step_logits(solo.decode(torch.tensor([[nexts[row]]])))[0])


@needs_compiler
def test_float_activations_write_transformers_greedy_text_from_the_same_q8_0_file(typed_files, tmp_path):
    """transformers dequantizes the file's Q8_0 blocks and multiplies in float32; so does --float-activations."""
    from transformers import AutoModelForCausalLM

    q8 = tmp_path / "model-q8_0.gguf"
    retyped(typed_files["smollm2-f32"], q8, ("Q8_0",), scale=0.002)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=q8.name, dtype=torch.float32).eval()
    run = manas("generate", "-m", q8, *RUN_OPTIONS, "-p", "the weather", "-n", "24", "-t", "0", "--float-activations",
                "--json").ok()  # fmt: skip
    record = run.json()
    ids = json.loads(manas("tokenize", "-m", q8, "--json", "the weather").ok().out)["ids"]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert record["tokens"] == expected[: len(record["tokens"])] and len(record["tokens"]) > 8


def test_quantize_on_a_gguf_is_refused_its_blocks_already_run(typed_files):
    run = manas("generate", "-m", typed_files["smollm2-mix"], *RUN_OPTIONS, "-p", "the", "--quantize", "int8")
    lines = run.err.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "already run as they are" in lines[0], run.err


@needs_compiler
def test_a_type_without_a_kernel_is_one_error_line_naming_the_type_and_the_tensor(typed_files, tmp_path):
    """IQ2_XXS (llama.cpp's 2-bit importance quantization) is not multiplied: said, never converted instead."""
    reader = gguf.GGUFReader(typed_files["smollm2-f32"])
    out = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(out, "llama")
    copy_fields(writer, reader.fields)
    for tensor in reader.tensors:
        values = np.array(tensor.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if tensor.name == "blk.1.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
            raw = np.zeros((values.shape[0], values.shape[1] // block * size), np.uint8)
            writer.add_tensor(tensor.name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    run = manas("generate", "-m", out, *RUN_OPTIONS, "-p", "the", "-n", "2")
    lines = run.err.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), run.err
    assert "IQ2_XXS" in lines[0] and "blk.1.ffn_up.weight" in lines[0] and "Traceback" not in run.err


@needs_compiler
@pytest.mark.parametrize("name, offset", [("Q4_K", 0), ("Q4_K", 2), ("Q6_K", 208), ("Q8_0", 0)])
def test_a_scale_that_is_not_finite_ends_the_run_with_one_error_line(typed_files, tmp_path, name, offset):
    """A NaN d (or dmin) in a block the model multiplies: its products are not finite, and the run says so."""
    path = tmp_path / "typed.gguf"
    retyped(typed_files["smollm2-f32"], path, (name,), scale=0.002)
    data = bytearray(path.read_bytes())
    from manas_cli.formats.gguf_metadata import read_layout

    layout = read_layout(path)
    tensor = next(t for t in layout.tensors if t.name == "blk.0.ffn_down.weight")
    at = layout.data_start + tensor.offset + offset
    data[at : at + 2] = np.float16(np.nan).tobytes()
    path.write_bytes(bytes(data))
    run = manas("generate", "-m", path, *RUN_OPTIONS, "-p", "the weather", "-n", "2", "-t", "0")
    lines = run.err.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), run.err
    assert "NaN or infinite" in lines[0] and "Traceback" not in run.err


@needs_compiler
def test_the_tokenizer_is_kept_validated_and_nothing_else_and_a_planted_entry_is_made_again(typed_files, tmp_path):
    """The cache keeps the validated tokenizer (under 1% of the file), never weights; an entry that is not the
    user's own regular file, or does not parse, is made again over it, and the text never changes."""
    path, env = typed_files["qwen2-mix"], {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    flags = ("-m", path, *RUN_OPTIONS, "-p", "the weather", "-n", "8", "-t", "0", "--json")
    expected = manas("generate", *flags, fresh=True, **env).ok().json()["tokens"]
    kept = list((tmp_path / "cache" / "manas").rglob("*.json"))
    assert len(kept) == 1 and kept[0].parent.name == "tokenizers"
    assert kept[0].stat().st_size < 0.01 * path.stat().st_size
    for plant in (lambda: kept[0].write_text("{not json"), lambda: kept[0].symlink_to(typed_files["smollm2-f32"])):
        kept[0].unlink()
        plant()
        assert manas("generate", *flags, fresh=True, **env).ok().json()["tokens"] == expected
        assert not kept[0].is_symlink() and json.loads(kept[0].read_text())["spec"]["kind"] == "bpe"


@needs_compiler
@pytest.mark.parametrize("cut", [0.5, 0.9, 0.999])
def test_a_truncated_gguf_is_one_error_line_before_the_core_reads_a_block(typed_files, tmp_path, cut):
    """A file cut inside its tensors' data: every extent is checked against the mapping first, so the core is never
    given a block past the end (under the sanitizers in .ci/run too)."""
    data = typed_files["qwen2-all"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * cut)])
    run = manas("generate", "-m", path, *RUN_OPTIONS, "-p", "the", "-n", "2")
    lines = run.err.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "past the end of the file" in lines[0], run.err


def rewritten(source, out, edit) -> None:
    """The GGUF at source written again, its tensors (name, float32 values) passed through edit(list) first."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    copy_fields(writer, reader.fields)
    shaped = [(t.name, np.array(t.data, np.float32).reshape(tuple(int(n) for n in reversed(t.shape))))
              for t in reader.tensors]  # fmt: skip
    for name, values in edit(shaped):
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


EDITS = {
    "a short bias": (lambda ts: [(n, v[:-1] if n == "blk.0.attn_q.bias" else v) for n, v in ts], "config needs"),
    "a wide layer": (
        lambda ts: [(n, np.pad(v, ((0, 4), (0, 0))) if n == "blk.1.ffn_up.weight" else v) for n, v in ts],
        "config needs",
    ),  # fmt: skip
    "a missing layer": (lambda ts: [(n, v) for n, v in ts if n != "blk.1.ffn_gate.weight"], "has no"),
    "a stray tensor": (lambda ts: [*ts, ("blk.0.attn_extra.weight", np.zeros((4, 256), np.float32))], "not part"),
    "rope_freqs": (lambda ts: [*ts, ("rope_freqs.weight", np.ones(32, np.float32))], "does not scale"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_tensor_the_config_does_not_describe_is_one_error_line_before_the_core_reads_it(typed_files, tmp_path, edit):
    """The core sizes its buffers by the config and reads each tensor by its shape: a file whose tensors disagree
    with its config (or hold one its architecture does not read, as a qwen2 file's rope_freqs) is refused first."""
    change, why = EDITS[edit]
    path = tmp_path / "edited.gguf"
    rewritten(typed_files["qwen2-f32"], path, change)
    run = manas("generate", "-m", path, *RUN_OPTIONS, "-p", "the", "-n", "2", "--engine", "native")
    lines = run.err.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and why in lines[0] and "Traceback" not in run.err, run.err
