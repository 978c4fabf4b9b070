"""int4 weights: the group quantizer, the Int4Linear product on both paths, the int4 version-2 file that
`manas quantize --bits 4` writes, `--quantize int4` through the CLI, quality against float32 and int8, and every
refusal."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from cli_fixtures import RUN_OPTIONS, TinyCheckpoint, checkpoints, generate, learned, manas, rope  # noqa: F401
from conftest import make_model
from manas_cli.formats.checkpoint import save_checkpoint
from manas_cli.torch_engine.quantize import (
    INT4_GROUP_SIZE,
    Int4Linear,
    dequantize_groups,
    pack_codes,
    quantize_groups,
    quantize_model,
    unpack_codes,
    weights_bytes,
    weights_name,
)
from test_cli_errors import assert_one_error_line
from test_quantize import BLOCK_LINEARS, TINY_BENCH, gpt2_quantization_error, rewrite

# ---- the quantizer and the product ------------------------------------------------------------------------------


def test_codes_pack_two_to_a_byte_low_nibble_first_and_unpack_exactly():
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_codes(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert packed[0, 0] == codes[0, 0] + 16 * codes[0, 1]
    assert torch.equal(unpack_codes(packed), codes.to(torch.uint8))


def test_quantize_groups_spans_each_groups_range_and_rounds_to_the_nearest_step():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 128, generator=generator) * torch.logspace(-3, 1, 70)[:, None]  # rows of every scale
    weight[3, 32:64] = 0.25  # a constant group must not divide by zero
    codes, scales, zeros = quantize_groups(weight)
    assert codes.shape == (70, 64) and scales.shape == zeros.shape == (70, 128 // INT4_GROUP_SIZE)
    assert scales.dtype == zeros.dtype == torch.bfloat16 and torch.isfinite(scales).all()
    values = unpack_codes(codes)
    assert (
        values.max() <= 15
        and (values.view(70, 4, 32).amax(-1) - values.view(70, 4, 32).amin(-1) >= 14).float().mean() > 0.9
    )
    error = (dequantize_groups(codes, scales, zeros) - weight).abs().view(70, 4, 32)
    # half a step, plus what rounding the zero to bfloat16 moved the grid by
    bound = (
        scales.float() / 2 + (zeros.float() - zeros.float().to(torch.bfloat16).float()).abs() + 1e-3 * scales.float()
    )
    assert (error <= bound[..., None] * 1.02 + zeros.float().abs()[..., None] * 2**-8).all()
    assert error[3, 1].max() <= 0.25 * 2**-7  # the constant group comes back (within bfloat16's zero)


@pytest.mark.parametrize("out_features", [48, 40])  # 40: not a multiple of 16, padded for the kernel
@pytest.mark.parametrize("rows", [1, 5, 100])
def test_int4_linear_kernel_and_dequantized_products_agree_within_bfloat16_rounding(out_features, rows):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, 64, generator=generator)
    bias = torch.nn.Parameter(torch.randn(out_features, generator=generator))
    stored = quantize_groups(weight)
    kernel, dequantized = Int4Linear(*stored, bias), Int4Linear(*stored, bias, kernel=False)
    assert kernel.kernel and not dequantized.kernel  # torch 2.13 has the kernel: it really runs
    x = torch.randn(rows, 64, generator=generator)
    expected = x.double() @ dequantize_groups(*stored, torch.float64).T + bias.double()
    for layer in (kernel, dequantized):
        y = layer(x)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    # the same numbers up to float32 summation order, then bfloat16 rounding: at most one bfloat16 step apart
    difference = (kernel(x) - dequantized(x)).abs()
    assert (difference <= (kernel(x) - bias).abs().clamp(min=1e-3) * 2**-7 + 1e-6).all()


def test_quantize_model_to_int4_replaces_the_linears_and_refuses_a_width_its_groups_do_not_divide():
    model = make_model("rope", "gqa")
    original = copy.deepcopy(model)
    quantize_model(model, "int4")
    for block in model.blocks:
        for name in BLOCK_LINEARS:
            assert isinstance(block.get_submodule(name), Int4Linear)
    assert isinstance(model.lm_head, Int4Linear)
    assert torch.equal(model.token_embedding.weight, original.token_embedding.weight)
    assert weights_name(model) == "int4" and model.num_parameters() == original.num_parameters()
    assert weights_bytes(model) < weights_bytes(original)
    with pytest.raises(ValueError, match="already quantized to int4"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match=r"n_embd \(48\) must be a multiple of 32"):
        quantize_model(make_model("rope", "gqa", n_embd=48), "int4")


def test_int4_on_gpt2_shaped_weights_keeps_logits_close_and_greedy_text_mostly_the_same():
    """The README's figures, next to int8's (tests/test_quantize.py): 64 prompt tokens, 64 greedy steps."""
    relative, top1, _ = gpt2_quantization_error("int4")
    # Random weights are 4 bits' worst case (no structure, nearly flat logits): measured 22%, 52% and 86%.
    # A trained model loses little (tests/test_shipped_model.py).
    assert relative < 0.35
    assert top1 >= 0.35


# ---- `manas quantize --bits 4` and its file ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def int4_files(checkpoints, tmp_path_factory) -> dict[str, TinyCheckpoint]:
    folder = tmp_path_factory.mktemp("int4")
    files = {}
    for name, checkpoint in checkpoints.items():
        out = folder / f"{name}-int4.safetensors"
        run = manas("quantize", checkpoint.path, "--bits", "4", "--out", out).ok()
        assert run.stdout == b"" and "to int4" in run.err.splitlines()[0]
        files[name] = TinyCheckpoint(f"{name}-int4", out)
    return files


def test_quantize_bits_4_writes_codes_scales_and_zeros_by_groups(checkpoints, int4_files):
    source, path = checkpoints["rope-gqa"].path, int4_files["rope-gqa"].path
    float_tensors, tensors = load_file(source), load_file(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    assert (metadata["format_version"], metadata["quantization"], metadata["group_size"]) == ("2", "int4", "32")
    matrices = [name for name, tensor in float_tensors.items() if tensor.dim() == 2]
    companions = {m.removesuffix("weight") + suffix for m in matrices for suffix in ("scales", "zeros")}
    assert set(tensors) == set(float_tensors) | companions
    for name, tensor in float_tensors.items():
        if name in matrices:
            codes, scales, zeros = quantize_groups(tensor)
            prefix = name.removesuffix("weight")
            assert tensors[name].dtype == torch.uint8 and torch.equal(tensors[name], codes)
            assert torch.equal(tensors[prefix + "scales"], scales) and torch.equal(tensors[prefix + "zeros"], zeros)
        else:
            assert torch.equal(tensors[name], tensor)
    # the matrices at half a byte a value, plus two bfloat16 numbers per 32 values: about 1/6 of float32's bytes
    float_bytes = sum(float_tensors[m].nbytes for m in matrices)
    int4_bytes = sum(
        tensors[m.removesuffix("weight") + suffix].nbytes for m in matrices for suffix in ("weight", "scales", "zeros")
    )
    assert int4_bytes < float_bytes / 5 and path.stat().st_size < source.stat().st_size


def test_an_int4_file_loads_as_the_quantized_model_with_the_embedding_read_back_from_its_codes(checkpoints, int4_files):
    quantized = TinyCheckpoint("at load", checkpoints["rope-gqa"].path, quantize="int4").loaded.model
    loaded = int4_files["rope-gqa"].loaded.model
    for name, tensor in quantized.state_dict().items():
        if name == "token_embedding.weight":
            head = quantized.lm_head
            assert torch.equal(loaded.token_embedding.weight, dequantize_groups(head.weight, head.scales, head.zeros))
        else:
            assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("name", ["rope-gqa", "learned-mha"])
@pytest.mark.parametrize("source", ["--quantize int4", "int4 file"])
def test_generate_on_int4_weights_equals_the_int4_models_crop_and_recompute(checkpoints, int4_files, name, source):
    if source == "int4 file":
        checkpoint, flags = int4_files[name], ()
    else:
        checkpoint, flags = TinyCheckpoint(name, checkpoints[name].path, quantize="int4"), ("--quantize", "int4")
    args = ("-p", "ROMEO:", "-n", "40", "--seed", "3", "--top-k", "20", "--num-samples", "2", "--json")
    records = generate(checkpoint, *flags, *args).ok().json_lines()
    expected = checkpoint.reference("ROMEO:", 40, temperature=0.8, top_k=20, seed=3, num_samples=2)
    assert [record["tokens"] for record in records] == expected
    assert all(record["weights"] == "int4" for record in records)


def test_bench_and_inspect_cache_name_int4_weights(rope, int4_files):
    report = manas("bench", "-c", rope.path, *RUN_OPTIONS, *TINY_BENCH, "--quantize", "int4", "--json").ok().json()
    int4_model = TinyCheckpoint("q", rope.path, quantize="int4").loaded.model
    assert report["model"]["weights"] == "int4" and report["model"]["weights_bytes"] == weights_bytes(int4_model)
    assert all(test["tokens_per_s_mean"] > 0 for test in report["tests"])
    header = manas("bench", "-c", int4_files["rope-gqa"].path, *RUN_OPTIONS, *TINY_BENCH).ok().out.splitlines()[1]
    assert "int4 weights" in header
    cache = manas("inspect-cache", "-c", int4_files["rope-gqa"].path, *RUN_OPTIONS, "--json").ok().json()
    assert cache["weights"] == "int4" and cache["dtype"] == "float32"


def test_score_and_export_read_an_int4_file(int4_files, tmp_path, shakespeare):
    path = int4_files["learned-mha"].path
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:2000], encoding="utf-8")
    assert manas("score", text, "-c", path, *RUN_OPTIONS, "--json").ok().json()["weights"] == "int4"
    manas("export", path, "--format", "hf", "--out", tmp_path / "hf").ok()
    exported, stored = load_file(tmp_path / "hf" / "model.safetensors"), load_file(path)
    up = dequantize_groups(*(stored[f"blocks.0.ffn.up.{suffix}"] for suffix in ("weight", "scales", "zeros")))
    assert torch.equal(exported["transformer.h.0.mlp.c_fc.weight"], up.T)


# ---- refusals -----------------------------------------------------------------------------------------------------


BAD_INT4_FILES = {  # change(tensors, metadata), what the error line names
    "missing zeros": (lambda t, m: t.pop("blocks.1.ffn.up.zeros"), ["missing tensor blocks.1.ffn.up.zeros"]),
    "mis-shaped scales": (
        lambda t, m: t.update({"blocks.0.attention.qkv.scales": torch.ones(64, 2)}),
        ["blocks.0.attention.qkv.scales", "[64, 2]", "[64, 1]"],
    ),
    "infinite scales": (
        lambda t, m: t["blocks.0.ffn.down.scales"].__setitem__((0, 0), float("inf")),
        ["blocks.0.ffn.down.scales", "infinite"],
    ),
    "zeros that overflow": (
        lambda t, m: (
            t["blocks.1.attention.output.scales"].__setitem__((2, 0), 3e37),
            t["blocks.1.attention.output.zeros"].__setitem__((2, 0), 2e38),
        ),
        ["blocks.1.attention.output.zeros", "infinite"],
    ),  # 8 × 3e37 + 2e38 > float32's range
    "NaN zeros": (
        lambda t, m: t["token_embedding.zeros"].__setitem__((0, 0), float("nan")),
        ["token_embedding.zeros", "NaN"],
    ),
    "group size that does not divide the rows": (lambda t, m: m.update(group_size="24"), ["group_size", "'24'", "32"]),
    "no group size": (lambda t, m: m.pop("group_size"), ["group_size", "None"]),
    "int4 codes where float belongs": (
        lambda t, m: t.update({"blocks.0.ln_ffn.weight": torch.ones(32, dtype=torch.uint8)}),
        ["blocks.0.ln_ffn.weight", "U8", "floating point"],
    ),
    "float where int4 codes belong": (
        lambda t, m: t.update({"blocks.1.ffn.down.weight": torch.ones(32, 64)}),
        ["blocks.1.ffn.down.weight", "F32", "int4"],
    ),
    "int8 codes in an int4 file": (
        lambda t, m: t.update({"blocks.1.ffn.down.weight": torch.ones(32, 64, dtype=torch.int8)}),
        ["blocks.1.ffn.down.weight", "I8", "int4"],
    ),
}


@pytest.mark.parametrize("case", BAD_INT4_FILES)
def test_a_bad_int4_file_is_one_error_line_naming_what_is_wrong(int4_files, tmp_path, case):
    change, names = BAD_INT4_FILES[case]
    path = rewrite(int4_files["rope-gqa"].path, tmp_path / "bad.safetensors", change)
    assert_one_error_line(manas("generate", "-c", path, *RUN_OPTIONS, "-p", "x", "-n", "2"), 1, str(path), *names)


def test_quantize_refuses_another_width_and_an_int4_file_and_a_model_its_groups_do_not_divide(
    rope, int4_files, tmp_path
):
    out = tmp_path / "out.safetensors"
    run = manas("quantize", rope.path, "--bits", "3", "--out", out)
    assert run.returncode == 2 and "use 8 (int8) or 4 (int4)" in run.err and not out.exists()
    again = manas("quantize", int4_files["rope-gqa"].path, "--bits", "4", "--out", out)
    assert_one_error_line(again, 1, "already quantized", "blocks.0.attention.qkv.weight", "int4")
    narrow = tmp_path / "narrow.safetensors"
    save_checkpoint(
        narrow,
        make_model("rope", "gqa", n_embd=48, vocab_size=rope.loaded.model.config.vocab_size),
        rope.loaded.tokenizer_spec,
    )
    for command in (
        ("quantize", narrow, "--bits", "4", "--out", out),
        ("generate", "-c", narrow, *RUN_OPTIONS, "--quantize", "int4", "-p", "x", "-n", "2"),
    ):
        assert_one_error_line(manas(*command), 1, str(narrow), "n_embd (48)", "multiple of 32", "int8")
    assert not out.exists()
