"""int8 weights: the quantizer, the Int8Linear product, quality against float32, the version-2 checkpoint that
`manas quantize` writes, `--quantize int8`, the reports that name the weights, and every refusal, through the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save

from cli_fixtures import RUN_OPTIONS, TinyCheckpoint, checkpoints, generate, learned, manas, rope  # noqa: F401
from conftest import engine_of, make_model
from manas_cli.engine.generation import generate as generate_tokens
from manas_cli.engine.sampling import Sampler
from manas_cli.torch_engine.model import GPT, GPTConfig, use_decode_layout
from manas_cli.torch_engine.quantize import (
    INT8_MAX,
    Int8Linear,
    dequantize_rows,
    quantize_model,
    quantize_rows,
    weights_bytes,
    weights_name,
)
from test_cli_errors import assert_one_error_line

TINY_BENCH = ("--tokens", "20", "--prompt-tokens", "16", "--repeat", "1", "--no-baseline")
BLOCK_LINEARS = ("attention.qkv", "attention.output", "ffn.up", "ffn.down")


# ---- the quantizer and the product ------------------------------------------------------------------------------


def test_quantize_rows_maps_each_rows_largest_magnitude_to_127_and_rounds_to_the_nearest_step():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 64, generator=generator) * torch.logspace(-3, 1, 300)[:, None]  # rows of every scale
    weight[7] = 0.0  # an all-zero row must not divide by zero
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and q.is_contiguous()
    assert scales.dtype == torch.bfloat16 and scales.shape == (300,)
    nonzero = torch.ones(300, dtype=torch.bool)
    nonzero[7] = False
    assert (q[nonzero].abs().amax(dim=1) == INT8_MAX).all()
    assert (q[7] == 0).all() and torch.isfinite(scales).all()
    error = (dequantize_rows(q, scales) - weight).abs()
    assert (error <= scales.float()[:, None] / 2 * 1.01).all()  # half a step (the bfloat16 scale's rounding aside)


def test_int8_linear_computes_x_times_the_dequantized_weights_within_bfloat16_rounding():
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 32, generator=generator), torch.nn.Parameter(torch.randn(96, generator=generator))
    q, scales = quantize_rows(weight)
    x = torch.randn(2, 5, 32, generator=generator)
    expected = x.double() @ dequantize_rows(q, scales, torch.float64).T + bias.double()
    for kernel in (None, False):
        y = Int8Linear(q, scales, bias, kernel)(x)
        assert y.shape == (2, 5, 96) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def off_boundary(tensor: torch.Tensor, offset: int = 24) -> torch.Tensor:
    """A copy of tensor whose data starts `offset` bytes past a 64-byte boundary, as in a mapped safetensors file."""
    raw = torch.empty(tensor.numel() * tensor.element_size() + 128, dtype=torch.uint8)
    start = -raw.data_ptr() % 64 + offset
    copy_ = raw[start : start + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
    copy_.copy_(tensor)
    assert copy_.data_ptr() % 64 == offset
    return copy_


@pytest.mark.parametrize("in_features", [32, 40])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_feeds_torchs_kernel_only_what_it_handles(in_features, rows):
    """torch's kernel reads garbage for rows not a multiple of 16 wide, and crashes on inputs off a 64-byte
    boundary: such a weight takes the dequantized product, and such inputs are copied first."""
    generator = torch.Generator().manual_seed(2)
    q, scales = quantize_rows(torch.randn(48, in_features, generator=generator))
    layer = Int8Linear(off_boundary(q), off_boundary(scales))
    assert layer.kernel == (in_features % 16 == 0)
    x = torch.randn(rows, in_features + 4, generator=generator).to(torch.bfloat16)[:, 4:]  # a view, off the boundary
    expected = x.double() @ dequantize_rows(q, scales, torch.float64).T
    torch.testing.assert_close(layer(x).double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_quantize_model_replaces_the_blocks_linears_and_the_output_layer_and_keeps_embeddings_and_norms():
    model = make_model("learned", "gqa")
    original = copy.deepcopy(model)
    quantize_model(model)
    for block in model.blocks:
        for name in BLOCK_LINEARS:
            layer = block.get_submodule(name)
            assert isinstance(layer, Int8Linear) and layer.weight.dtype == torch.int8
    assert isinstance(model.lm_head, Int8Linear)
    # the output layer is a quantized copy of the tied embedding; the lookup keeps the float rows
    assert torch.equal(model.token_embedding.weight, original.token_embedding.weight)
    error = (dequantize_rows(model.lm_head.weight, model.lm_head.scales) - original.token_embedding.weight).abs()
    assert (error <= model.lm_head.scales.float()[:, None] / 2 * 1.01).all()
    for name, tensor in original.state_dict().items():
        if "ln_" in name or "norm" in name or "position_embedding" in name or name.endswith("bias"):
            assert torch.equal(model.state_dict()[name], tensor), name
    assert model.num_parameters() == original.num_parameters()
    assert weights_name(model) == "int8" and weights_name(original) == "float32"
    assert weights_bytes(model) < weights_bytes(original)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model)


def test_the_decode_layout_leaves_int8_layers_as_they_are():
    model = quantize_model(make_model("rope", "mqa"))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items() if tensor.dtype == torch.int8}
    use_decode_layout(model)
    for name, tensor in before.items():
        after = model.state_dict()[name]
        assert torch.equal(after, tensor) and after.is_contiguous()


def gpt2_small_random(seed: int = 0) -> GPT:
    """GPT-2-124M's shape with GPT-2's initialization (normal 0.02, scaled residual projections)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()


def gpt2_quantization_error(kind: str) -> tuple[float, float, float]:
    """GPT-2-124M's shape, random init, quantized to `kind`, against float32 on a 64-token prompt: the largest logit
    difference over the largest logit, the share of the prompt's positions whose top token agrees, and the share of
    the 64 steps of float32's greedy continuation whose top token agrees (both models read float32's text, so one
    step that differs does not change the text the later ones read: counting the greedy tokens two free runs share
    counts where the first difference fell, which moves with the last bits of the CPU's float kernels)."""
    float_model = gpt2_small_random()
    quantized = quantize_model(copy.deepcopy(float_model), kind)
    prompt = torch.randint(50257, (1, 64), generator=torch.Generator().manual_seed(0))
    greedy = [step.tokens[0] for step in generate_tokens(engine_of(float_model), prompt, Sampler(0.0), 64)]
    text = torch.cat([prompt, torch.tensor([greedy[:-1]])], dim=1)
    with torch.inference_mode():
        logits, quantized_logits = float_model(text), quantized(text)
    tops, quantized_tops = logits.argmax(-1)[0], quantized_logits.argmax(-1)[0]
    relative = ((quantized_logits - logits)[:, :64].abs().max() / logits[:, :64].abs().max()).item()
    top1 = (quantized_tops[:64] == tops[:64]).float().mean().item()
    steps = (quantized_tops[63:] == tops[63:]).float().mean().item()
    print(
        f"{kind}: largest logit difference {relative:.2%} of the largest logit; top-1 agrees at {top1:.0%} of the "
        f"prompt's positions and at {steps:.0%} of float32's 64 greedy steps"
    )
    return relative, top1, steps


def test_int8_on_gpt2_shaped_weights_keeps_logits_close_and_greedy_text_mostly_the_same():
    """The README's figures: on 1 thread, 64 prompt tokens, 64 greedy steps."""
    relative, _, steps = gpt2_quantization_error("int8")
    assert relative < 0.06  # measured 2.5%
    assert steps >= 0.8  # measured 97%


# ---- `manas quantize` and the version-2 file ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def int8_files(checkpoints, tmp_path_factory) -> dict[str, TinyCheckpoint]:
    folder = tmp_path_factory.mktemp("int8")
    files = {}
    for name, checkpoint in checkpoints.items():
        out = folder / f"{name}-int8.safetensors"
        run = manas("quantize", checkpoint.path, "--out", out).ok()
        assert run.stdout == b"" and str(out) in run.err
        files[name] = TinyCheckpoint(f"{name}-int8", out)
    return files


@pytest.mark.parametrize("name", ["rope-gqa", "learned-mha"])
def test_quantize_writes_a_version_2_file_of_int8_matrices_and_their_scales(checkpoints, int8_files, name):
    source, path = checkpoints[name].path, int8_files[name].path
    float_tensors, tensors = load_file(source), load_file(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format_version"] == "2" and metadata["quantization"] == "int8"
    matrices = [
        name for name, tensor in float_tensors.items() if tensor.dim() == 2 and name != "position_embedding.weight"
    ]
    assert "token_embedding.weight" in matrices and len(matrices) == 1 + 2 * len(BLOCK_LINEARS)
    assert set(tensors) == set(float_tensors) | {m.removesuffix("weight") + "scales" for m in matrices}
    for name, tensor in float_tensors.items():
        if name in matrices:
            q, scales = quantize_rows(tensor)
            assert torch.equal(tensors[name], q) and torch.equal(
                tensors[name.removesuffix("weight") + "scales"], scales
            )
        else:
            assert torch.equal(tensors[name], tensor)
    # the tiny model's tokenizer metadata is a good part of these files; GPT-2's is 3.9× smaller
    assert path.stat().st_size < source.stat().st_size / 2.4


def test_an_int8_file_loads_as_the_quantized_model_with_the_embedding_read_back_from_its_int8_rows(
    checkpoints, int8_files
):
    quantized = TinyCheckpoint("at load", checkpoints["rope-gqa"].path, quantize=True).loaded.model
    loaded = int8_files["rope-gqa"].loaded.model
    for name, tensor in quantized.state_dict().items():
        if name == "token_embedding.weight":  # the file has no float copy: its int8 rows, dequantized
            assert torch.equal(
                loaded.token_embedding.weight, dequantize_rows(quantized.lm_head.weight, quantized.lm_head.scales)
            )
        else:
            assert torch.equal(loaded.state_dict()[name], tensor), name


def test_quantize_refuses_to_overwrite_without_force_and_replaces_with_it(rope, int8_files):
    out = int8_files["rope-gqa"].path
    before = out.read_bytes()
    assert_one_error_line(manas("quantize", rope.path, "--out", out, fresh=True), 1, str(out), "--force")
    assert out.read_bytes() == before
    out.unlink()  # a new file, not the old one truncated: tensors loaded earlier may still map it
    out.write_bytes(b"not a checkpoint")
    manas("quantize", rope.path, "--out", out, "--force", fresh=True).ok()
    assert out.read_bytes() != b"not a checkpoint"
    assert torch_files_equal(out.read_bytes(), before)  # the same tensors and metadata again
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def torch_files_equal(a: bytes, b: bytes) -> bool:
    """Same tensors and metadata (safetensors writes the metadata keys in no fixed order)."""
    header = [json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"] for data in (a, b)]
    tensors = [load(data) for data in (a, b)]
    return (
        header[0] == header[1]
        and tensors[0].keys() == tensors[1].keys()
        and all(torch.equal(tensors[0][name], tensors[1][name]) for name in tensors[0])
    )


# ---- generate, bench and inspect-cache on int8 weights ------------------------------------------------------------


@pytest.mark.parametrize("name", ["rope-gqa", "learned-mha"])
@pytest.mark.parametrize("source", ["--quantize int8", "int8 file"])
def test_generate_on_int8_weights_equals_the_int8_models_crop_and_recompute(checkpoints, int8_files, name, source):
    if source == "int8 file":
        checkpoint, flags = int8_files[name], ()
    else:
        checkpoint, flags = TinyCheckpoint(name, checkpoints[name].path, quantize=True), ("--quantize", "int8")
    args = ("-p", "ROMEO:", "-n", "40", "--seed", "3", "--top-k", "20", "--num-samples", "2", "--json")
    records = generate(checkpoint, *flags, *args).ok().json_lines()
    expected = checkpoint.reference("ROMEO:", 40, temperature=0.8, top_k=20, seed=3, num_samples=2)
    assert [record["tokens"] for record in records] == expected
    assert all(record["weights"] == "int8" for record in records)


def test_generate_json_says_the_weights_are_float32_by_default(rope):
    assert generate(rope, "-p", "ROMEO:", "-n", "3", "--json").ok().json()["weights"] == "float32"


def test_bench_reports_int8_weights_and_their_bytes_in_json_and_in_its_header(rope, int8_files):
    float_report = manas("bench", "-c", rope.path, *RUN_OPTIONS, *TINY_BENCH, "--json").ok().json()["model"]
    assert float_report["weights"] == "float32" and float_report["weights_bytes"] == weights_bytes(rope.loaded.model)
    int8_model = TinyCheckpoint("q", rope.path, quantize=True).loaded.model
    report = manas("bench", "-c", rope.path, *RUN_OPTIONS, *TINY_BENCH, "--quantize", "int8", "--json").ok().json()
    assert report["model"]["weights"] == "int8"
    assert report["model"]["weights_bytes"] == weights_bytes(int8_model) < float_report["weights_bytes"]
    assert report["model"]["parameters"] == float_report["parameters"]
    assert all(test["tokens_per_s_mean"] > 0 for test in report["tests"])
    # an int8 file needs no flag; its output layer is its only copy of the embedding's rows in int8
    header = manas("bench", "-c", int8_files["rope-gqa"].path, *RUN_OPTIONS, *TINY_BENCH).ok().out.splitlines()[1]
    assert "int8 weights" in header and "float32" in header  # int8 weights, float32 activations between products


def test_inspect_cache_names_the_weights(rope):
    report = manas("inspect-cache", "-c", rope.path, *RUN_OPTIONS, "--quantize", "int8", "--json").ok().json()
    assert report["weights"] == "int8" and report["weights_bytes"] > 0
    assert report["dtype"] == "float32"  # the cache holds float keys and values
    text = manas("inspect-cache", "-c", rope.path, *RUN_OPTIONS, "--quantize", "int8").ok().out
    assert "int8 weights" in text
    float_report = manas("inspect-cache", "-c", rope.path, *RUN_OPTIONS, "--json").ok().json()
    assert float_report["weights"] == "float32"


def test_export_writes_an_int8_checkpoints_weights_dequantized(learned, int8_files, tmp_path):
    path = int8_files["learned-mha"].path
    manas("export", path, "--format", "hf", "--out", tmp_path / "hf").ok()
    exported, stored = load_file(tmp_path / "hf" / "model.safetensors"), load_file(path)

    def dequantized(name: str) -> torch.Tensor:
        return dequantize_rows(stored[f"{name}.weight"], stored[f"{name}.scales"])

    assert torch.equal(exported["transformer.wte.weight"], dequantized("token_embedding"))
    assert torch.equal(exported["transformer.h.0.mlp.c_fc.weight"], dequantized("blocks.0.ffn.up").T)
    assert torch.equal(exported["transformer.h.1.attn.c_proj.bias"], stored["blocks.1.attention.output.bias"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"


# ---- refusals -------------------------------------------------------------------------------------------------


def rewrite(source, target, change):
    """A copy of a checkpoint with its tensors and metadata changed by change(tensors, metadata)."""
    with safe_open(source, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(source)
    change(tensors, metadata)
    target.write_bytes(save(tensors, metadata=metadata))
    return target


BAD_INT8_FILES = {  # (quantized source?, change, what the error line names)
    "missing scales": (True, lambda t, m: t.pop("blocks.1.ffn.up.scales"), ["missing tensor blocks.1.ffn.up.scales"]),
    "mis-shaped scales": (
        True,
        lambda t, m: t.update({"blocks.0.attention.qkv.scales": torch.ones(7)}),
        ["blocks.0.attention.qkv.scales", "[7]"],
    ),
    "int8 where float is expected": (
        True,
        lambda t, m: t.update({"blocks.0.ln_ffn.weight": torch.ones(32, dtype=torch.int8)}),
        ["blocks.0.ln_ffn.weight", "I8", "floating point"],
    ),
    "int8 in a float file": (
        False,
        lambda t, m: t.update({"blocks.1.ffn.down.weight": torch.ones(32, 128, dtype=torch.int8)}),
        ["blocks.1.ffn.down.weight", "I8", "floating point"],
    ),
    "float where int8 is expected": (
        True,
        lambda t, m: t.update({"blocks.1.attention.output.weight": torch.ones(32, 32)}),
        ["blocks.1.attention.output.weight", "F32", "int8"],
    ),
    "unknown quantization": (True, lambda t, m: m.update(quantization="int2"), ["'int2'", "int8", "int4"]),
}


@pytest.mark.parametrize("case", BAD_INT8_FILES)
def test_a_bad_int8_file_is_one_error_line_naming_the_tensor(rope, int8_files, tmp_path, case):
    quantized, change, names = BAD_INT8_FILES[case]
    source = int8_files["rope-gqa"].path if quantized else rope.path
    path = rewrite(source, tmp_path / "bad.safetensors", change)
    assert_one_error_line(manas("generate", "-c", path, *RUN_OPTIONS, "-p", "x", "-n", "2"), 1, str(path), *names)


@pytest.mark.parametrize("command", [("generate", "-p", "x", "--quantize", "int8"), ("quantize", "--out", "{out}")])
def test_quantizing_an_int8_checkpoint_again_is_refused_naming_an_int8_tensor(int8_files, tmp_path, command):
    path = int8_files["rope-gqa"].path
    args = [arg.replace("{out}", str(tmp_path / "again.safetensors")) for arg in command]
    run = manas(args[0], *(["-c", path] if args[0] != "quantize" else [path]), *args[1:])
    assert_one_error_line(run, 1, str(path), "already quantized", "blocks.0.attention.qkv.weight")
    assert not (tmp_path / "again.safetensors").exists()


def test_training_does_not_resume_from_int8_weights(int8_files, tmp_path, shakespeare):
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:5000], encoding="utf-8")
    path = int8_files["learned-mha"].path
    run = manas("train", text, "--out", path, "--resume", "--steps", "1", "--device", "cpu", "--threads", "1")
    assert_one_error_line(run, 1, str(path), "int8")
