"""The native core: its logits against the torch model for every configuration it runs, cached == full window and
batched == alone bit for bit, and its build: cached per user, refused folders, no compiler, a broken compiler."""

from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from cli_fixtures import MANAS, RUN_OPTIONS, cli, cli_env
from conftest import BLOCK_SIZE, all_logits, cache_layers, make_model, native_model, needs_compiler, step_logits
from manas_cli.engine.threads import usable_cpus
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.native import build
from manas_cli.native.binding import declare
from manas_cli.native.model import linears
from manas_cli.native.session import NativeSession, decode_rows
from manas_cli.torch_engine.model import GPT, use_decode_layout
from manas_cli.torch_engine.quantize import is_quantized, quantizable, quantize_model

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare.safetensors"

# The Llama family's choices, as config fields over the tiny model (n_embd 32, 4 heads): Llama's block with an
# untied output layer, Qwen2's biases on q, k, v only, and a head size that is not n_embd / n_head (the heads 64
# wide). Hidden widths are multiples of 32, as int4's groups need.
FAMILIES = {
    "gpt2": {},
    "llama": dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=96, tie_embeddings=False),
    "qwen2": dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=64, qkv_bias=True),
    "head-dim": dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=64, head_dim=16),
}

# Every configuration the core runs: position encoding, head layout, bias, GELU, weights, family.
CONFIGURATIONS = [
    (pe, layout, bias, gelu, weights, "gpt2")
    for pe in ("learned", "rope")
    for layout in ("mha", "gqa", "mqa")
    for bias in (True, False)
    for gelu in ("tanh", "none")
    for weights in ("float32", "int8", "int4")
] + [
    ("rope", "gqa", False, "tanh", weights, family)
    for family in FAMILIES
    if family != "gpt2"
    for weights in ("float32", "int8", "int4")
]


def configuration_id(configuration: tuple) -> str:
    pe, layout, bias, gelu, weights, family = configuration
    shape = f"{pe}-{layout}-{'bias' if bias else 'no-bias'}-gelu-{gelu}" if family == "gpt2" else family
    return f"{shape}-{weights}"


def configured_model(pe: str, layout: str, bias: bool, gelu: str, weights: str, family: str = "gpt2", **overrides):
    model = make_model(pe, layout, bias=bias, gelu_approximate=gelu, **FAMILIES[family], **overrides)
    return model if weights == "float32" else quantize_model(model, weights)


def dequantized_reference(model: GPT) -> GPT:
    """The float32 torch model a quantized one stands for: every quantized layer (the output layer too, a quantized
    copy of the embedding) as an nn.Linear holding its dequantized weights, which are exact in float32."""
    if not is_quantized(model):
        return model
    reference = copy.deepcopy(model)
    for name in quantizable(reference):
        layer = reference.get_submodule(name)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        linear.weight = nn.Parameter(layer.dequantized(torch.float32))
        linear.bias = layer.bias
        parent, _, child = name.rpartition(".")
        setattr(reference.get_submodule(parent) if parent else reference, child, linear)
    return reference.eval()


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(300, (batch, length), generator=torch.Generator().manual_seed(seed))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to the logits' scale (their largest magnitude)."""
    return ((got - expected).abs().max() / expected.abs().max()).item()


X86_WITH_AVX2_AND_FMA = platform.machine() == "x86_64" and {"avx2", "fma"} <= set(build.cpu_features().split())


@needs_compiler
@pytest.mark.slow
@pytest.mark.skipif(not X86_WITH_AVX2_AND_FMA, reason="needs an x86-64 CPU with AVX2 and FMA")
def test_integer_products_are_the_same_bits_from_every_instruction_set_build(tmp_path, request):
    """The same source built for this CPU (AVX-512 VNNI where it has it: the core the other tests load, built as the
    CLI builds it), for AVX2 and for plain C with FMA: the integer sums are exact and combined in one order, so the
    logits are identical, bit for bit. Marked slow, so it starts first: under CI's sanitizers its two builds take a
    minute, so they start before it asks for the host's core, which the other worker is building meanwhile."""
    flags = [flag for flag in build.FLAGS if not flag.startswith("-march")]
    builds = {  # the two builds at once: each takes a core for seconds (a minute under the sanitizers)
        tmp_path / f"core{n}.so": subprocess.Popen(
            [build.compiler(), *flags, *march, "-o", str(tmp_path / f"core{n}.so"), str(build.SOURCE), *build.LIBRARIES]
        )
        for n, march in enumerate((["-march=haswell"], ["-march=x86-64", "-mfma"]), start=1)
    }
    native_library = request.getfixturevalue("native_library")
    assert [compiler.wait() for compiler in builds.values()] == [0, 0]
    libraries = [native_library, *(declare(ctypes.CDLL(str(path))) for path in builds)]
    for weights, width in (("int8", 64), ("int8", 40), ("int4", 64), ("int4", 96)):
        model = configured_model("rope", "gqa", True, "tanh", weights, n_embd=width, n_head=4)
        ids = random_ids(2, BLOCK_SIZE)
        logits = [all_logits(native_model(model, library), ids) for library in libraries]
        assert all(torch.equal(logits[0], other) for other in logits[1:])


@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=configuration_id)
def test_native_logits_equal_the_torch_models_within_float32_rounding(native_library, configuration):
    """With float activations (int8's integer products have their own reference, below)."""
    model = configured_model(*configuration)
    ids = random_ids(2, BLOCK_SIZE)
    with torch.inference_mode():
        expected = dequantized_reference(model)(ids)
    got = all_logits(native_model(model, native_library, float_activations=True), ids)
    assert got.shape == expected.shape
    assert relative_error(got, expected) <= 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_native_quantized_logits_stay_near_the_torch_engines_bfloat16_activations(native_library, weights):
    """torch's engine rounds each quantized product's input and output to bfloat16 (its kernels' limit); the core
    keeps float32: the two differ by that rounding, not by more."""
    model = configured_model("rope", "gqa", True, "tanh", weights)
    ids = random_ids(2, BLOCK_SIZE)
    with torch.inference_mode():
        torch_engine = model(ids)
    assert (
        relative_error(all_logits(native_model(model, native_library, float_activations=True), ids), torch_engine)
        <= 2**-5
    )


class BlockQuantizedInput(nn.Module):
    """What the core's integer products compute, in torch: the input quantized per block of 32 (scale max|x| / 127,
    codes round(x · 127 / max|x|), halves to even), then the layer over its exact dequantized weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(-1)
        padded = torch.nn.functional.pad(x, (0, -n % 32)).unflatten(-1, (-1, 32))
        largest = padded.abs().amax(-1, keepdim=True)
        codes = torch.round(padded * torch.where(largest > 0, 127.0 / largest, 0.0))
        return self.linear((codes * (largest / 127.0)).flatten(-2)[..., :n])


def takes_integer_products(layer: nn.Module) -> bool:
    """int8 layers always; int4 layers of whole groups of 64 inputs and weight groups of whole blocks of 32 (the
    rest multiply in float32)."""
    if not hasattr(layer, "group_size"):
        return True
    return layer.in_features % 64 == 0 and layer.group_size % 32 == 0


def integer_reference(model: GPT) -> GPT:
    """dequantized_reference with the input of every layer whose products run in integers block-quantized as the
    core quantizes it."""
    reference = dequantized_reference(model)
    for name in quantizable(model):
        if takes_integer_products(model.get_submodule(name)):
            parent, _, child = name.rpartition(".")
            holder = reference.get_submodule(parent) if parent else reference
            setattr(holder, child, BlockQuantizedInput(getattr(holder, child)))
    return reference


def position_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Each position's largest difference relative to its logits' scale, (B·T,)."""
    return ((got - expected).abs().amax(-1) / expected.abs().amax(-1)).flatten()


INTEGER_CASES = (
    [(pe, "int8", width, "gpt2") for pe in ("learned", "rope") for width in (64, 40, 48)]
    + [(pe, "int4", width, "gpt2") for pe in ("learned", "rope") for width in (64, 128)]
    + [("learned", "int4", 96, "gpt2")]
    + [("rope", weights, 64, family) for weights in ("int8", "int4") for family in ("llama", "qwen2")]
)


@pytest.mark.parametrize("pe, weights, width, family", INTEGER_CASES)
def test_integer_products_equal_block_quantized_activations_in_torch(native_library, pe, weights, width, family):
    """The default quantized path against its own reference: position by position within float rounding, but where
    an activation lands on a rounding boundary (torch and the core differ upstream in their last bits, and one code
    rounds the other way, and the positions after it in that sequence follow: 8 sequences, so that one early flip
    is not a quarter of the positions). The float path matches the reference nowhere. int4 at width 96: the
    attention's products (96 inputs) in float32, the feed-forward's (384) in integers."""
    model = configured_model(pe, "gqa", True, "tanh", weights, family, n_embd=width, n_head=4)
    ids = random_ids(8, BLOCK_SIZE)
    with torch.inference_mode():
        expected = integer_reference(model)(ids)
    got = all_logits(native_model(model, native_library), ids)
    floats = all_logits(native_model(model, native_library, float_activations=True), ids)
    assert (position_errors(got, expected) <= 1e-5).float().mean() >= 0.75
    assert not (position_errors(floats, expected) <= 1e-5).any()


@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=configuration_id)
def test_a_cached_decode_step_is_bit_for_bit_the_full_windows_position(native_library, configuration):
    """Through a prefill, decode steps to the full window, and a re-prefill of the cropped window."""
    native = native_model(configured_model(*configuration), native_library)
    sequence = random_ids(2, 3 * BLOCK_SIZE // 2, seed=1)
    session = NativeSession(native)
    logits = step_logits(session.prefill(sequence[:, :3]))
    for end in range(3, sequence.size(1)):
        window = sequence[:, :end][:, -BLOCK_SIZE:]
        assert torch.equal(logits[:, 0], all_logits(native, window)[:, -1])
        if session.positions == BLOCK_SIZE:
            logits = step_logits(session.prefill(sequence[:, : end + 1][:, -BLOCK_SIZE:]))
        else:
            logits = step_logits(session.decode(sequence[:, end : end + 1]))


# Query and key/value heads whose decode attention takes a key head's query heads in groups of up to four
# (SmolLM2's 9 over 3, a 7-head group as Qwen2.5-0.5B's, every head its own), one head size with a tail past a
# vector's 16 lanes, and the 64-wide heads of the models people run (four vectors a step).
LONG_CACHE_HEADS = [(9, 3, 16), (7, 1, 16), (3, 3, 24), (2, 1, 64)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("heads", LONG_CACHE_HEADS, ids=lambda h: f"{h[0]}q-{h[1]}kv-hs{h[2]}")
def test_a_decode_step_over_a_long_cache_is_the_windows_position_bit_for_bit(native_library, heads, threads):
    """A decode step reads its cache a block of positions at a time (attention.c, attend_pass), each thread its
    share of the heads: over several blocks and a partial one, on any number of threads, every step's logits are
    the full window's last position's."""
    n_head, n_kv_head, head_dim = heads
    model = make_model(
        "rope",
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
        n_embd=48,
        block_size=80,
        norm="rmsnorm",
        mlp="swiglu",
        ffn_hidden=64,
    )
    native = native_model(model, native_library, threads)
    sequence = random_ids(1, 75, seed=3)
    session = NativeSession(native)
    logits = step_logits(session.prefill(sequence[:, :2]))
    for end in range(2, sequence.size(1)):
        if end in (2, 17, 33, 50, 74):
            assert torch.equal(logits[:, 0], all_logits(native, sequence[:, :end])[:, -1]), end
        logits = step_logits(session.decode(sequence[:, end : end + 1]))


@pytest.mark.parametrize("logit_rows", [[3], [-1], [0, 1, 2, 0]], ids=["past-the-rows", "negative", "too-many"])
def test_the_core_is_never_asked_for_the_logits_of_a_row_it_did_not_run(native_library, logit_rows):
    """The last layer gathers the logit rows into scratch sized for the call's rows: Python checks them first."""
    native = native_model(configured_model("rope", "gqa", True, "tanh", "float32"), native_library)
    session = NativeSession(native)
    session.allocate(1, 3)
    with pytest.raises(IndexError, match="logit rows"):
        native.run([1, 2, 3], [0, 1, 2], [session.cache(0)] * 3, logit_rows)


def test_a_pool_of_more_threads_than_cores_sleeps_between_jobs_and_gives_the_same_bits(native_library):
    """More threads than the process's cores: the pool never spins (every wait sleeps on a condition), and a
    prefill and decode steps are what one thread computes, bit for bit."""
    model = configured_model("rope", "gqa", True, "tanh", "int8")
    ids = random_ids(2, BLOCK_SIZE, seed=3)
    alone = all_logits(native_model(model, native_library, threads=1), ids)
    crowded = native_model(model, native_library, threads=usable_cpus() + 2)
    assert torch.equal(all_logits(crowded, ids), alone)
    session = NativeSession(crowded)
    session.prefill(ids[:, :5])
    assert torch.equal(step_logits(session.decode(ids[:, 5:6]))[:, 0], alone[:, 5])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_rows_decoded_together_equal_each_row_alone_bit_for_bit(native_library, weights, threads):
    """Continuous batching's step: sessions at different positions in one call give each session's own logits,
    on any number of threads."""
    model = configured_model("rope", "gqa", True, "tanh", weights)
    native = native_model(model, native_library, threads)
    prompts = [random_ids(1, length, seed=length) for length in (2, 5, 9, 13)]
    together = [NativeSession(native) for _ in prompts]
    alone = [NativeSession(native_model(model, native_library, 1)) for _ in prompts]
    for session, solo, prompt in zip(together, alone, prompts):
        assert torch.equal(step_logits(session.prefill(prompt)), step_logits(solo.prefill(prompt)))
    nexts = random_ids(len(prompts), 1, seed=99)
    logits = step_logits(decode_rows(native, nexts[:, 0].tolist(), together))
    for row, (session, solo) in enumerate(zip(together, alone)):
        assert torch.equal(logits[row], step_logits(solo.decode(nexts[row : row + 1]))[0])
        assert session.positions == solo.positions


def test_the_shipped_model_on_the_core_matches_torch_over_its_whole_window(native_library):
    model = load_checkpoint(SHIPPED).model
    ids = random_ids(1, model.config.block_size)
    with torch.inference_mode():
        expected = model(ids)
    got = all_logits(native_model(model, native_library, 2), ids)
    assert relative_error(got, expected) <= 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_core_reads_the_torch_models_own_memory_but_its_layers_panels(native_library):
    """One copy, made at load: the linear layers' rows regrouped as panels (core.c, PANEL_UNIT); every other
    tensor is the torch model's own memory, so a change to it is what the core computes with next."""
    model = make_model("rope", "gqa")
    native = native_model(model, native_library)
    ids = random_ids(1, 4)
    before = all_logits(native, ids)
    with torch.no_grad():
        model.blocks[0].ffn.up.weight.mul_(2)  # 32 float32 inputs: 128-byte rows, read from the panels
    assert torch.equal(all_logits(native, ids), before)
    with torch.no_grad():
        model.blocks[0].ffn.up.weight.div_(2)
        model.blocks[0].ln_ffn.weight.mul_(2)
    after = all_logits(native, ids)
    assert not torch.equal(before, after)
    with torch.inference_mode():
        assert relative_error(after, model(ids)) <= 1e-4


@pytest.mark.parametrize(
    "weights, width", [("float32", 128), ("int8", 128), ("int4", 128), ("int4", 64), ("int4", 192)]
)
def test_panels_change_where_weights_are_read_not_the_logits_bit_for_bit(native_library, weights, width):
    """Rows read from panels (and int4's scales and zeros laid out with them) or as stored, the same logits bit
    for bit: an output layer of 301 rows (the last panel part padding), both integer and float products, prefill
    and decode. int4 rows of 64 and 192 inputs are 32 and 96 bytes: their panels pad each row to whole units (as
    SmolLM2's 576 inputs, 288 bytes)."""
    model = configured_model("rope", "gqa", True, "tanh", weights, n_embd=width, vocab_size=301)
    ids = random_ids(2, BLOCK_SIZE, seed=5)
    for float_activations in (False, True):
        packed = native_model(model, native_library, float_activations=float_activations)
        stored = native_model(model, native_library, float_activations=float_activations)
        layers = [layer for layer in linears(stored.bound) if layer.panels]
        assert layers and packed.panel_bytes > 0
        for layer in layers:
            layer.panels = None
        assert torch.equal(all_logits(packed, ids), all_logits(stored, ids))
        sessions = [NativeSession(packed), NativeSession(stored)]
        first, second = (step_logits(session.prefill(ids[:, :5])) for session in sessions)
        assert torch.equal(first, second)
        first, second = (step_logits(session.decode(ids[:, 5:6])) for session in sessions)
        assert torch.equal(first, second)


def test_the_core_refuses_weights_it_does_not_run(native_library):
    with pytest.raises(ValueError, match="float32 weights on the CPU, not torch.bfloat16"):
        native_model(make_model("rope").to(torch.bfloat16), native_library)
    with pytest.raises(ValueError, match="contiguous"):
        native_model(use_decode_layout(make_model("rope")), native_library)


# ---- the build ----


def run_generate(*args: str, env: dict, prompt: str = "ROMEO:") -> subprocess.CompletedProcess:
    return cli("generate", "-p", prompt, "-n", "8", "-t", "0", *RUN_OPTIONS, *args, env=env, text=True)


def fresh_cache_env(tmp_path: Path, **overrides: str) -> dict:
    """An empty cache folder, and a $CC whose "compile" copies the library this test run has built already with the
    real compiler and flags: these tests are about where the library goes, when it is built again and what runs,
    not about what the compiler makes (the bit-for-bit tests check that, on the real build), and a real -O3 build of
    the core costs 5 s of CPU each. A test that names its own CC (overrides) gets it."""
    env = cli_env(XDG_CACHE_HOME=str(tmp_path / "cache"), CC=str(copying_compiler(tmp_path)))
    env.update(overrides)
    return env


def copying_compiler(tmp_path: Path) -> Path:
    """Written once per test (the library's name keys on the compiler file's modification time)."""
    path = tmp_path / "copying-cc"
    if not path.exists():
        built = build.build().path
        script = f'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\nexec cp "{built}" "$out"'
        fake_compiler(tmp_path, script, name=path.name)
    return path


@needs_compiler
def test_the_first_run_compiles_once_into_the_users_cache_and_later_runs_load_it(tmp_path):
    env = fresh_cache_env(tmp_path)
    first = run_generate("--json", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("compiled the native core in") == 1
    assert json.loads(first.stdout)["engine"] == "native"
    folder = tmp_path / "cache" / "manas"
    (library,) = folder.glob("core-*.so")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not stat.S_IMODE(library.stat().st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
    second = run_generate("--json", env=env)
    assert second.returncode == 0 and "compiled" not in second.stderr
    assert json.loads(second.stdout)["tokens"] == json.loads(first.stdout)["tokens"]


@needs_compiler
def test_two_first_runs_at_once_both_succeed_and_one_compiles(tmp_path):
    env = fresh_cache_env(tmp_path)
    command = [*MANAS, "generate", "-p", "ROMEO:", "-n", "4", "-t", "0", *RUN_OPTIONS, "--json"]
    runs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    results = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], results
    assert sum(stderr.count("compiled the native core") for _, stderr in results) == 1
    assert all(json.loads(stdout)["engine"] == "native" for stdout, _ in results)
    assert len(list((tmp_path / "cache" / "manas").glob("core-*.so"))) == 1
    assert not list((tmp_path / "cache" / "manas").glob(".build-*"))  # no temporary left behind


@needs_compiler
@pytest.mark.parametrize("which", ["the folder", "its parent"])
def test_a_cache_folder_others_can_write_is_refused_for_one_private_folder_reused(tmp_path, which):
    folder = tmp_path / "cache" / "manas"
    folder.mkdir(parents=True, mode=0o700)
    (folder if which == "the folder" else folder.parent).chmod(0o777)
    env = private_tmp_env(tmp_path)
    fallback = Path(env["TMPDIR"]) / f"manas-native-{os.getuid()}"
    reason = (
        "can be written by other users"
        if which == "the folder"
        else f"is inside {folder.parent}, which can be written by other users"
    )
    runs = [run_generate("--json", env=env) for _ in range(2)]
    for result in runs:
        assert result.returncode == 0, result.stderr
        assert f"{folder} {reason}: the native core is built in {fallback} instead" in result.stderr
        assert json.loads(result.stdout)["engine"] == "native"
    assert "compiled the native core" in runs[0].stderr and "compiled" not in runs[1].stderr  # the same folder, reused
    assert len(list(fallback.glob("core-*.so"))) == 1 and stat.S_IMODE(fallback.stat().st_mode) == 0o700
    assert not list(folder.glob("core-*.so"))  # nothing written where another user could replace it


@needs_compiler
def test_a_sticky_folder_above_the_cache_is_trusted_like_tmp(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o1777)
    (tmp_path / "cache").chmod(0o1777)
    result = run_generate("--json", env=fresh_cache_env(tmp_path))
    assert result.returncode == 0 and "instead" not in result.stderr, result.stderr
    assert len(list((tmp_path / "cache" / "manas").glob("core-*.so"))) == 1


def private_tmp_env(tmp_path: Path) -> dict:
    """fresh_cache_env with the system's temporary folder (where the fallback folder lives) inside tmp_path."""
    (tmp_path / "tmp").mkdir(mode=0o700)
    return fresh_cache_env(tmp_path, TMPDIR=str(tmp_path / "tmp"))


@needs_compiler
def test_a_truncated_cached_library_is_rebuilt(tmp_path):
    env = fresh_cache_env(tmp_path)
    assert run_generate(env=env).returncode == 0
    (library,) = (tmp_path / "cache" / "manas").glob("core-*.so")
    library.write_bytes(library.read_bytes()[:4096])
    again = run_generate("--json", env=env)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("compiled the native core in") == 1
    assert json.loads(again.stdout)["engine"] == "native"


@needs_compiler
@pytest.mark.skipif(os.getuid() == 0, reason="root writes into a read-only folder all the same")
def test_a_cache_folder_that_cannot_be_written_gives_the_private_one(tmp_path):
    folder = tmp_path / "cache" / "manas"
    folder.mkdir(parents=True, mode=0o500)
    result = run_generate("--json", env=private_tmp_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"{folder} cannot be written" in result.stderr
    assert json.loads(result.stdout)["engine"] == "native"


def test_unsafe_reason_names_what_is_wrong(tmp_path):
    open_to_all = tmp_path / "open-folder"
    open_to_all.mkdir()
    open_to_all.chmod(0o775)
    assert build.unsafe_reason(open_to_all.lstat()) == "can be written by other users"
    link = tmp_path / "link"
    link.symlink_to(open_to_all)
    assert build.unsafe_reason(link.lstat()) == "is a symbolic link"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert build.unsafe_reason(private.lstat()) is None


def cached_names(tmp_path: Path) -> tuple[Path, Path]:
    """Where a run with fresh_cache_env(tmp_path) keeps the library and its digest (the folder made private)."""
    folder = tmp_path / "cache" / "manas"
    folder.mkdir(parents=True, mode=0o700, exist_ok=True)
    library = folder / build.library_name(str(copying_compiler(tmp_path)))
    return library, library.with_name(library.name + ".sha256")


@needs_compiler
@pytest.mark.parametrize("planted", ["library", "digest"])
def test_a_fifo_named_as_the_library_or_its_digest_is_never_waited_on(tmp_path, planted):
    env = fresh_cache_env(tmp_path)
    library, digest = cached_names(tmp_path)
    if planted == "digest":
        assert run_generate(env=env).returncode == 0
        digest.unlink()
    os.mkfifo(library if planted == "library" else digest, 0o600)
    result = run_generate("--json", env=env)  # a blocking open would hang until the timeout
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("compiled the native core in") == 1 and json.loads(result.stdout)["engine"] == "native"
    assert stat.S_ISREG(library.stat().st_mode) and stat.S_ISREG(digest.stat().st_mode)


@needs_compiler
def test_a_cached_library_lacking_an_entry_point_is_rebuilt(tmp_path):
    library, digest = cached_names(tmp_path)
    forged = tmp_path / "forged.c"
    forged.write_text(f"int manas_abi_version(void) {{ return {build.ABI_VERSION}; }}\n")
    subprocess.run([build.compiler(), "-shared", "-fPIC", "-o", str(library), str(forged)], check=True)
    digest.write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")
    result = run_generate("--json", env=fresh_cache_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("compiled the native core in") == 1 and json.loads(result.stdout)["engine"] == "native"


@needs_compiler
def test_temporaries_a_killed_build_left_are_removed(tmp_path):
    library, _ = cached_names(tmp_path)
    stale = [library.with_name(f".build-{library.name}-x1y2.so"), library.with_name(f".digest-{library.name}-z3")]
    for path in stale:
        path.write_bytes(b"half")
    result = run_generate(env=fresh_cache_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert not any(path.exists() for path in stale)


@needs_compiler
def test_the_library_is_loaded_from_the_descriptor_that_was_checked(tmp_path):
    """Whatever replaces the file after it was opened and checked, the checked file is what loads."""
    checked = tmp_path / "core.so"
    shutil.copyfile(build.build().path, checked)
    opened = os.open(checked, os.O_RDONLY)
    fd = os.dup2(opened, 900)  # a descriptor no earlier load named: the loader answers a name it holds from memory
    os.close(opened)
    try:
        swapped = tmp_path / "swapped.c"
        swapped.write_text(f"int manas_abi_version(void) {{ return {build.ABI_VERSION}; }}\n")
        subprocess.run(
            [build.compiler(), "-shared", "-fPIC", "-o", str(tmp_path / "swapped.so"), str(swapped)], check=True
        )
        os.replace(tmp_path / "swapped.so", checked)
        library = build.load(fd, checked)  # the swapped library lacks the entry points: it would be refused
    finally:
        os.close(fd)
    assert build.self_test(library) is None


def test_a_hung_compiler_is_stopped_with_everything_it_started(tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    cc = fake_compiler(tmp_path, f"sleep 300 & echo $! > {pid_file}; wait")
    monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 2)
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    with pytest.raises(build.NativeUnavailable, match="was still running after 2 s, so it was stopped"):
        build.compile_library(str(cc), folder / "core-test.so")
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is sent; the process ends a moment later
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child)
    assert not list(folder.iterdir())  # its temporary removed


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie that no one has reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_without_a_compiler_torch_runs_and_asking_for_native_is_one_error_line(tmp_path):
    env = fresh_cache_env(tmp_path, CC=str(tmp_path / "no-such-cc"))
    auto = run_generate("--json", env=env)
    assert auto.returncode == 0, auto.stderr
    assert json.loads(auto.stdout)["engine"] == "torch" and auto.stderr == ""
    asked = run_generate("--json", "--engine", "native", env=env)
    assert asked.returncode == 1 and asked.stdout == ""
    assert asked.stderr.strip() == (
        f"error: the native engine cannot run: no C compiler ($CC={tmp_path / 'no-such-cc'} "
        "not found) (--engine auto runs the torch engine instead)"
    )


def fake_compiler(tmp_path: Path, body: str, name: str = "fake-cc") -> Path:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_failing_compiler_is_never_a_crash_and_debug_shows_its_message(tmp_path):
    calls = tmp_path / "calls"
    cc = fake_compiler(
        tmp_path,
        f'echo >> {calls}; case "$1" in --version) echo "fake cc 1.0";; '
        '*) echo "core.c:1: fatal: no headers" >&2; exit 1;; esac',
    )
    env = fresh_cache_env(tmp_path, CC=str(cc))
    result = run_generate("--engine", "native", env=env)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: the native engine cannot run: the C compiler")
    assert "failed on the native core" in result.stderr and "fatal: no headers" not in result.stderr
    debug = run_generate("--engine", "native", "--debug", env=env)
    assert debug.returncode == 1 and "core.c:1: fatal: no headers" in debug.stderr
    auto = run_generate("--json", env=env)  # auto: torch, quietly, and the failure is remembered, not retried
    assert auto.returncode == 0 and json.loads(auto.stdout)["engine"] == "torch" and auto.stderr == ""
    assert calls.read_text().count("\n") == 1
    assert not list((tmp_path / "cache" / "manas").glob("core-*.so"))


def test_a_library_that_will_not_load_is_never_a_crash(tmp_path):
    cc = fake_compiler(
        tmp_path,
        'case "$1" in --version) echo "fake cc 2.0";; *) while [ "$1" != "-o" ]; do '
        'shift; done; echo "not a library" > "$2";; esac',
    )
    result = run_generate("--json", env=fresh_cache_env(tmp_path, CC=str(cc)))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["engine"] == "torch"
    asked = run_generate("--engine", "native", "--json", env=fresh_cache_env(tmp_path, CC=str(cc)))
    assert (
        asked.returncode == 1 and "error: the native engine cannot run: the native core does not load" in asked.stderr
    )


def test_a_hung_compiler_is_waited_on_once_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A compiler that hangs is stopped at the limit, once: the next build of the same source with the same
    compiler fails at once, naming the earlier run, and the cache folder holds no temporary file."""
    calls = tmp_path / "calls"
    cc = fake_compiler(tmp_path, f"echo >> {calls}; sleep 300")
    monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 2)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(build.NativeUnavailable, match="was still running after 2 s"):
        build.build()
    with pytest.raises(build.NativeUnavailable, match="in an earlier run: delete .*failed to try again"):
        build.build()
    assert calls.read_text().count("\n") == 1
    left = sorted(path.suffix for path in (tmp_path / "cache" / "manas").iterdir())
    assert left == [".failed", ".lock"]


@pytest.mark.parametrize(
    "flags, reason",
    [
        (("--dtype", "bfloat16"), "the core runs float32, int8 and int4 weights, not bfloat16"),
        (("--dtype", "float16"), "the core runs float32, int8 and int4 weights, not float16"),
    ],
)
def test_asking_for_native_where_it_cannot_run_is_one_error_line_naming_why(tmp_path, flags, reason):
    result = run_generate("--engine", "native", "--json", *flags, env=fresh_cache_env(tmp_path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        f"error: the native engine cannot run: {reason} (--engine auto runs the torch engine instead)"
    )


@pytest.mark.parametrize("value", ["torch", pytest.param("native", marks=needs_compiler)])
def test_the_engine_comes_from_the_environment_too(tmp_path, value):
    result = run_generate("--json", env=fresh_cache_env(tmp_path, MANAS_ENGINE=value))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["engine"] == value


def test_an_unknown_engine_is_refused_naming_the_choices(tmp_path):
    result = run_generate("--engine", "fast", env=fresh_cache_env(tmp_path))
    assert result.returncode == 2
    assert "'fast' is not one of 'auto', 'native', 'torch'" in result.stderr


def test_the_library_exports_only_its_prefixed_entry_points(native_library):
    """Every other symbol is static: nothing can bind to a libc function of the same name (glibc's `step`)."""
    path = build.build().path
    nm = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True)
    if nm.returncode:
        pytest.skip("no nm to list the library's symbols")
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.split()[1] in "TDB"}
    assert exported and all(name.startswith("manas_") for name in exported), exported


@needs_compiler
def test_the_library_is_keyed_by_source_flags_compiler_and_cpu(monkeypatch):
    cc = build.compiler()
    name = build.library_name(cc)
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-DANOTHER_BUILD"))
    assert build.library_name(cc) != name
    monkeypatch.undo()
    monkeypatch.setattr(build, "cpu_features", lambda: "another cpu")
    assert build.library_name(cc) != name


@needs_compiler
def test_bench_and_score_name_the_engine(tmp_path):
    env = fresh_cache_env(tmp_path)
    quick_bench = ("bench", "-n", "4", "--prompt-tokens", "4", "-r", "1", "--no-baseline", *RUN_OPTIONS)
    bench = cli(*quick_bench, "--json", env=env, text=True)
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["model"]["engine"] == "native"
    table = cli(*quick_bench, "--engine", "torch", env=env, text=True)
    assert "torch engine" in table.stdout
    score = cli("score", *RUN_OPTIONS, "--json", stdin="To be, or not to be: that is it.", env=env, text=True)
    assert json.loads(score.stdout)["engine"] == "native"


def test_native_and_torch_score_the_same_text_alike(shakespeare_held_out, tmp_path):
    env = fresh_cache_env(tmp_path)
    scores = {}
    for engine in ("native", "torch"):
        done = cli(
            "score", *RUN_OPTIONS, "--engine", engine, "--json", stdin=shakespeare_held_out[:6000], env=env, text=True
        )
        assert done.returncode == 0, done.stderr
        scores[engine] = json.loads(done.stdout)
    assert scores["native"]["tokens"] == scores["torch"]["tokens"]
    assert abs(scores["native"]["nats_per_token"] - scores["torch"]["nats_per_token"]) < 1e-4


@needs_compiler
def test_torch_is_given_one_thread_when_the_core_runs():
    """torch only samples beside the core: its OpenMP workers must not spin on the core's cores."""
    code = (
        "import torch, sys; from manas_cli.models import ModelOptions; "
        "from manas_cli.cli.commands.common import load_model; "
        "_, _, engine = load_model(ModelOptions(threads=2)); print(engine.name, torch.get_num_threads(), "
        "engine.threads)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert done.stdout.split() == ["native", "1", "2"], done.stderr


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_a_prefill_extended_from_a_kept_or_copied_prefix_is_a_whole_prefill_bit_for_bit(
    native_library, weights, family
):
    """What a chat's turns and the server's prefix cache rest on: the first positions kept (extend) or copied from a
    snapshot (restore), the rest prefilled, give the logits and the cache a prefill of the whole gives."""
    native = native_model(configured_model("rope", "gqa", True, "tanh", weights, family), native_library)
    ids = random_ids(1, BLOCK_SIZE, seed=7)[0].tolist()
    whole = NativeSession(native)
    expected = step_logits(whole.prefill([ids])).clone()
    earlier = NativeSession(native)
    earlier.prefill([ids[:9] + [5, 6]])  # an earlier turn: its first 9 tokens are this prompt's
    assert torch.equal(step_logits(earlier.extend([ids], 9)), expected)
    copied = NativeSession(native)
    copied.restore(earlier.snapshot(), 9)
    assert torch.equal(step_logits(copied.extend([ids], 9)), expected)
    for session in (earlier, copied):
        assert all(torch.equal(a, b) for pair in zip(cache_layers(session), cache_layers(whole)) for a, b in zip(*pair))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_a_decoded_cache_handed_over_holds_what_a_prefill_of_its_tokens_holds(native_library, weights, family):
    """What the prefix cache keeps of a finished request: its prompt prefilled and its answer decoded token by
    token, handed over without a copy (its room past the positions included), restored into another row and
    extended: the logits of a whole prefill, bit for bit."""
    native = native_model(configured_model("rope", "gqa", True, "tanh", weights, family), native_library)
    ids = random_ids(1, BLOCK_SIZE, seed=8)[0].tolist()
    expected = step_logits(NativeSession(native).prefill([ids])).clone()
    answered = NativeSession(native)
    answered.prefill([ids[:5]])
    for token in ids[5:12]:  # the answer's tokens, each decoded
        answered.decode([token])
    snapshot = answered.hand_over()
    assert snapshot.positions == 12 and snapshot.size > 12 and answered.positions == 0
    copied = NativeSession(native)
    copied.restore(snapshot, 12)
    assert torch.equal(step_logits(copied.extend([ids], 12)), expected)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_prompts_run_in_the_decode_rows_call_as_they_run_alone(native_library, weights, family):
    """A server's step (run_rows): two rows decoding, a new prompt and a prompt extending a restored start, all in
    one call; each row's logits and cache are those of its own prefill, extend or decode, bit for bit."""
    from manas_cli.native.session import run_rows

    native = native_model(configured_model("rope", "gqa", True, "tanh", weights, family), native_library)
    ids = random_ids(4, BLOCK_SIZE, seed=9).tolist()
    alone, together = [NativeSession(native) for _ in range(4)], [NativeSession(native) for _ in range(4)]
    for sessions in (alone, together):
        sessions[0].prefill([ids[0][:6]])
        sessions[1].prefill([ids[1][:11]])
    earlier = NativeSession(native)
    earlier.prefill([ids[3][:7]])
    together[3].restore(earlier.snapshot(), 7, 14)
    expected = [
        alone[0].decode([ids[0][6]]),
        alone[1].decode([ids[1][11]]),
        alone[2].prefill([ids[2][:15]]),
        alone[3].prefill([ids[3][:14]]),
    ]
    logits = run_rows(
        native,
        [
            (together[0], [ids[0][6]]),
            (together[1], [ids[1][11]]),
            (together[2], ids[2][:15]),
            (together[3], ids[3][7:14]),
        ],
    )
    for row in range(4):
        assert torch.equal(step_logits(logits[row : row + 1]), step_logits(expected[row]))
        assert together[row].positions == alone[row].positions
        pairs = zip(cache_layers(together[row]), cache_layers(alone[row]))
        assert all(torch.equal(a, b) for pair in pairs for a, b in zip(*pair))


def test_a_step_over_a_second_is_told_on_a_pipe_and_a_quick_one_is_not(tmp_path):
    """A first run's compile (here a compiler that takes 2 s) is a line on stderr before it ends; a run that loads
    the built core says nothing of loading."""
    copying = copying_compiler(tmp_path)
    slow = fake_compiler(tmp_path, f'[ "$1" = --version ] && exec {copying} "$@"\nsleep 2\nexec {copying} "$@"', "slow")
    env = fresh_cache_env(tmp_path, CC=str(slow))
    first = run_generate(env=env)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    assert lines[0] == "compiling the native core (once per version of manas, compiler and CPU)..." and lines[
        1
    ].startswith("compiled the native core in"), lines
    assert run_generate(env=env).stderr == ""


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_a_speculative_check_gives_each_positions_decode_step_bit_for_bit(native_library, weights, family):
    """What speculation's exactness rests on (engine/speculation.py): k + 1 tokens checked in one pass over the cache
    give, row by row, the logits k + 1 decode steps give; a rewind keeps the cache a step would have left."""
    native = native_model(configured_model("rope", "gqa", True, "tanh", weights, family), native_library)
    ids = random_ids(1, BLOCK_SIZE, seed=9)[0].tolist()
    stepped = NativeSession(native)
    stepped.prefill([ids[:7]])
    expected = [step_logits(stepped.decode([token])).clone() for token in ids[7:12]]
    checked = NativeSession(native)
    checked.prefill([ids[:7]])
    logits = checked.check(ids[7:12])
    assert all(torch.equal(step_logits(logits[i : i + 1]), expected[i]) for i in range(5))
    checked.rewind(9)  # two of the five kept: the next step is the one after them
    stepped_again = NativeSession(native)
    stepped_again.prefill([ids[:7]])
    for token in ids[7:9]:
        stepped_again.decode([token])
    assert torch.equal(step_logits(checked.decode([ids[9]])), step_logits(stepped_again.decode([ids[9]])))
