"""One seed, one text, on every CPU (issue 35): the native core built for other instruction sets (x86-64 without
FMA, x86-64-v3, x86-64-v4, this CPU), by gcc and clang, and for aarch64 (run under qemu-user), gives the shipped
model's logits over its whole window and 20 seeds' sampled tokens bit for bit as the host build does, and so for
GGUF files' blocks (issue 70). Python
cannot run under emulation cheaply, so each target runs tests/native_driver.c (core.c included whole) over a plain
binary dump of the model and the run that this module writes.

Targets whose compiler or emulator is missing are skipped with the reason; CI installs them and sets
MANAS_REQUIRE_ALL_TARGETS=1, which turns such a skip into a failure."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from cli_fixtures import RUN_OPTIONS, checkpoints, cli, generate_with_compiler, manas, rope  # noqa: F401
from conftest import all_logits, native_model, needs_compiler, shared_folder
from manas_cli.formats.gguf_weights import BLOCK_TYPES
from manas_cli.formats.header import open_checkpoint
from manas_cli.native import build
from manas_cli.native.binding import WEIGHTS_F32, WEIGHTS_GGML, WEIGHTS_INT4, WEIGHTS_INT8, ManasLinear, ManasModel
from manas_cli.native.model import NativeGPT

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "shakespeare.safetensors"
HELD_OUT = ROOT / "tests" / "data" / "tinyshakespeare-held-out.txt"
DRIVER = ROOT / "tests" / "native_driver.c"
SEEDS = list(range(20))  # the shipped model's; its int8 and int4 copies take the first 5, over 64 positions
NEW_TOKENS = 16  # per seed (an emulated aarch64 run of a dump takes 5-20 s)
REQUIRE_ALL = os.environ.get("MANAS_REQUIRE_ALL_TARGETS") == "1"
X86 = platform.machine() == "x86_64"
FLAGS = ["-O3", "-ffp-contract=off", "-pthread"]


def bytes_at(pointer, count: int) -> bytes:
    """count bytes from a ctypes pointer; empty where it is NULL or count is 0."""
    return ctypes.string_at(ctypes.cast(pointer, ctypes.c_void_p).value, count) if pointer and count else b""


def floats_at(pointer, count: int) -> bytes:
    return bytes_at(pointer, 4 * count)


def array(data: bytes) -> bytes:
    return struct.pack("<q", len(data)) + data


def linear_bytes(linear: ManasLinear) -> bytes:
    n_in, n_out = linear.n_in, linear.n_out
    weight_bytes = {WEIGHTS_F32: 4 * n_in * n_out, WEIGHTS_INT8: n_in * n_out, WEIGHTS_INT4: n_in * n_out // 2}
    if linear.kind == WEIGHTS_GGML:  # a GGUF file's blocks: its type's bytes per block of values
        _, values, block_bytes = BLOCK_TYPES[linear.group]
        weight_bytes[WEIGHTS_GGML] = n_out * n_in // values * block_bytes
    scales = {WEIGHTS_INT8: n_out, WEIGHTS_INT4: n_out * n_in // max(linear.group, 1)}.get(linear.kind, 0)
    zeros = scales if linear.kind == WEIGHTS_INT4 else 0
    return b"".join(
        [
            struct.pack("<4i", linear.kind, n_in, n_out, linear.group),
            array(bytes_at(linear.weight, weight_bytes[linear.kind])),
            array(bytes_at(linear.scales, 2 * scales)),  # bfloat16
            array(bytes_at(linear.zeros, 2 * zeros)),
            array(floats_at(linear.bias, n_out)),
        ]
    )


def norm_bytes(norm, width: int) -> bytes:
    return array(floats_at(norm.weight, width)) + array(floats_at(norm.bias, width))


CONFIG_FIELDS = (
    "vocab_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "head_size",
    "ffn_width",
    "rope",
    "gelu_tanh",
    "rms_norm",
    "swiglu",
    "integer_products",
)


def write_dump(path: Path, m: ManasModel, prompt: list[int], seed_prompt: list[int], seeds: list[int]) -> None:
    """The model the core was bound to (its every tensor, as the core reads it) and the run, in the layout
    native_driver.c reads: native_driver.c's main says which field is which."""
    C = m.n_embd
    parts = [
        b"MANASDMP",
        struct.pack(f"<{len(CONFIG_FIELDS)}i", *(getattr(m, name) for name in CONFIG_FIELDS)),
        struct.pack("<fd", m.norm_eps, m.rope_base),
        array(floats_at(m.token_embedding, m.vocab_size * C)),
        array(floats_at(m.position_embedding, m.block_size * C)),
    ]
    for layer in m.layers[: m.n_layer]:
        parts += [norm_bytes(layer.ln_attention, C), linear_bytes(layer.qkv), linear_bytes(layer.output)]
        parts += [norm_bytes(layer.ln_ffn, C), linear_bytes(layer.gate), linear_bytes(layer.up)]
        parts += [linear_bytes(layer.down)]
    parts += [norm_bytes(m.final_norm, C), linear_bytes(m.lm_head)]
    parts += [struct.pack("<i", m.rope_halves), linear_bytes(m.token_table)]
    parts += [linear_bytes(layer.key) + linear_bytes(layer.value) for layer in m.layers[: m.n_layer]]
    parts += [array(floats_at(m.rope_factors, m.head_size // 2))]  # Llama 3's scaled rope; Qwen3's head norms
    parts += [
        norm_bytes(layer.q_norm, m.head_size) + norm_bytes(layer.k_norm, m.head_size) for layer in m.layers[: m.n_layer]
    ]
    parts += [struct.pack(f"<i{len(prompt)}i", len(prompt), *prompt)]
    parts += [struct.pack(f"<i{len(seed_prompt)}i", len(seed_prompt), *seed_prompt)]
    parts += [struct.pack("<ifif", NEW_TOKENS, 0.8, 40, 0.95), struct.pack(f"<i{len(seeds)}Q", len(seeds), *seeds)]
    path.write_bytes(b"".join(parts))


def compile_driver(compiler: list[str], flags: list[str], out: Path) -> Path:
    done = subprocess.run(
        [*compiler, *FLAGS, *flags, "-o", str(out), str(DRIVER), "-lm"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return out


def missing(reason: str) -> None:
    if REQUIRE_ALL:
        pytest.fail(f"{reason} (MANAS_REQUIRE_ALL_TARGETS=1: CI installs it)")
    pytest.skip(reason)


def target(name: str) -> tuple[list[str], list[str], list[str]]:
    """(compiler argv, flags, the runner's argv prefix) of a target, or a skip naming what is missing."""
    gcc, clang = build.compiler(), shutil.which("clang")
    if name == "aarch64":
        cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
        if not cross or not qemu:
            missing("aarch64 needs gcc-aarch64-linux-gnu and qemu-user (Debian packages)")
        return [cross], ["-march=armv8-a", "-static"], [qemu]
    if not X86:
        pytest.skip("the x86-64 targets need an x86-64 host")
    if name == "clang":
        if not clang:
            missing("the clang target needs clang (Debian's clang)")
        return [clang], ["-march=native"], []
    march = {"x86-64": ["-march=x86-64"], "x86-64-v3": ["-march=x86-64-v3"], "native": ["-march=native"]}
    if name == "x86-64-v4":
        if "avx512f" not in build.cpu_features().split():
            pytest.skip("x86-64-v4 needs a CPU with AVX-512 to run on")
        march[name] = ["-march=x86-64-v4"]
    return [gcc], march[name], []


KINDS = ("float32", "int8", "int4", "gguf-q4_k_m", "gguf-q8_0", "gguf-qwen3")
GGUF_KINDS = {
    "gguf-q4_k_m": ("qwen2", ("Q4_K", "Q6_K", "Q5_0", "Q8_0")),
    "gguf-q8_0": ("llama", ("Q8_0",)),  # with rope_freqs: Llama 3's scaled rope
    "gguf-qwen3": ("qwen3", ("Q4_K", "Q6_K")),  # head norms, heads wider than the width / heads
}


def checkpoint_of(kind: str, folder: Path) -> Path:
    return SHIPPED if kind == "float32" else folder / (f"{kind}.gguf" if kind in GGUF_KINDS else f"{kind}.safetensors")


def bound(kind: str, folder: Path, native_library) -> tuple[NativeGPT, list[int]]:
    """The kind's model as the core binds it, and the prompt its dump runs over: the whole window for float32 (the
    held-out text), 64 positions for its int8 and int4 copies and the GGUF files (random ids: a byte vocabulary)."""
    if kind in GGUF_KINDS:
        from manas_cli.formats.gguf_weights import GGUFWeights, open_gguf

        model = NativeGPT(GGUFWeights(open_gguf(checkpoint_of(kind, folder)), native_library), native_library, 1)
        return model, torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    header = open_checkpoint(checkpoint_of(kind, folder))
    model = native_model(header, native_library)
    positions = model.config.block_size if kind == "float32" else 64
    return model, header.header.encoding.encode(HELD_OUT.read_text(encoding="utf-8")[:4000])[:positions]


def write_gguf(path: Path, architecture: str) -> None:
    """A random f32 model of llama.cpp's `architecture`, 256 wide (a K-quant's superblock), with a byte vocabulary:
    qwen2 with q, k, v biases, qwen3 with head norms and heads of 128, llama with rope_freqs."""
    import gguf
    import numpy as np

    from manas_cli.formats.tokenizer import bytes_to_unicode

    width, hidden, layers, heads, kv_heads, vocabulary = 256, 512, 2, 4, 2, 256
    head = 128 if architecture == "qwen3" else width // heads
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(128), writer.add_embedding_length(width), writer.add_feed_forward_length(hidden)
    writer.add_block_count(layers), writer.add_head_count(heads), writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0), writer.add_layer_norm_rms_eps(1e-6), writer.add_key_length(head)
    writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre("default")
    writer.add_token_list([bytes_to_unicode()[b] for b in range(vocabulary)])
    writer.add_token_types([1] * vocabulary)
    rng = np.random.default_rng(11)
    tensors = {"token_embd.weight": (vocabulary, width), "output_norm.weight": (width,)}
    for i in range(layers):
        tensors |= {f"blk.{i}.attn_norm.weight": (width,), f"blk.{i}.ffn_norm.weight": (width,)}
        for part, rows in (("q", heads * head), ("k", kv_heads * head), ("v", kv_heads * head)):
            tensors[f"blk.{i}.attn_{part}.weight"] = (rows, width)
            if architecture == "qwen2":
                tensors[f"blk.{i}.attn_{part}.bias"] = (rows,)
        if architecture == "qwen3":
            tensors |= {f"blk.{i}.attn_q_norm.weight": (head,), f"blk.{i}.attn_k_norm.weight": (head,)}
        tensors |= {f"blk.{i}.attn_output.weight": (width, heads * head), f"blk.{i}.ffn_gate.weight": (hidden, width),
                    f"blk.{i}.ffn_up.weight": (hidden, width), f"blk.{i}.ffn_down.weight": (width, hidden)}  # fmt: skip
    for name, shape in tensors.items():
        scale = 0.1 if len(shape) == 2 else 0.05
        values = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
        writer.add_tensor(name, values + np.float32(1) if name.endswith("norm.weight") else values)
    if architecture == "llama":
        writer.add_tensor("rope_freqs.weight", np.geomspace(1, 32, head // 2).astype(np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def write_dumps(folder: Path, native_library) -> None:
    """The shipped model as float32, int8 and int4 (`manas quantize`), and three GGUF files (a Q4_K_M-like mix of a
    qwen2 model, a Q8_0 llama with rope_freqs, a qwen3 of Q4_K and Q6_K), each bound by the core as the engine
    binds it, dumped with its prompt and a short prompt for the seeds (all 20 for float32, 5 for the others); then
    the driver built as the engine builds the core (-march=native, gcc), and each dump's output."""
    from test_real_models import retyped

    for bits in (8, 4):
        assert cli("quantize", SHIPPED, "--bits", bits, "--out", checkpoint_of(f"int{bits}", folder)).returncode == 0
    for kind, (architecture, types) in GGUF_KINDS.items():
        write_gguf(folder / f"{kind}-f32.gguf", architecture)
        retyped(folder / f"{kind}-f32.gguf", checkpoint_of(kind, folder), types, scale=0.0005)
    shipped_prompt = open_checkpoint(SHIPPED).header.encoding.encode("ROMEO:")
    for kind in KINDS:
        model, window = bound(kind, folder, native_library)
        seed_prompt = [10, 20, 30] if kind in GGUF_KINDS else shipped_prompt
        write_dump(folder / f"{kind}.dump", model.bound, window, seed_prompt, SEEDS if kind == "float32" else SEEDS[:5])
    driver = compile_driver([build.compiler()], ["-march=native"], folder / "driver")
    for kind in KINDS:
        (folder / f"{kind}.out").write_text(run_driver([], driver, folder / f"{kind}.dump"))


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, worker_id, native_library) -> Path:
    """The folder of write_dumps, written once per run: the workers share it."""
    return shared_folder(tmp_path_factory, worker_id, "one-seed", lambda folder: write_dumps(folder, native_library))


@pytest.fixture(scope="module")
def host_outputs(dumps) -> dict[str, str]:
    return {kind: (dumps / f"{kind}.out").read_text() for kind in KINDS}


def run_driver(runner: list[str], driver: Path, dump: Path, threads: int = 1) -> str:
    done = subprocess.run([*runner, str(driver), str(dump), str(threads)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


@needs_compiler
def test_the_driver_prints_the_engines_own_logits_bit_for_bit(dumps, host_outputs, native_library):
    """The host build of the driver is the engine: its prefill logits are the Python engine's, bit for bit, so a
    target that agrees with it agrees with manas."""
    for name in KINDS:
        model, window = bound(name, dumps, native_library)
        logits = all_logits(model, torch.tensor([window]))[0]
        bits = logits.contiguous().view(torch.int32).numpy().astype("uint32")
        expected = [f"prefill {r}: " + " ".join(f"{b:08x}" for b in row) for r, row in enumerate(bits)]
        assert host_outputs[name].splitlines()[: len(expected)] == expected
        seeds = [line for line in host_outputs[name].splitlines() if line.startswith("seed ")]
        assert (
            len(seeds) == (len(SEEDS) if name == "float32" else 5) and len({line.split("|")[0] for line in seeds}) > 1
        )


@needs_compiler
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("aarch64", marks=pytest.mark.slow),  # emulated: about 90 s
        pytest.param("x86-64", marks=pytest.mark.slow),  # fmaf calls: about 20 s
        "x86-64-v3",
        "x86-64-v4",
        "native",
        "clang",
    ],
)
def test_every_target_gives_the_hosts_bits(name, dumps, host_outputs, tmp_path):
    """The shipped model's logits over its whole window and 20 seeds' tokens (and a hash of every decode step's
    logits), its int8 and int4 copies' (integer products), and three GGUF files' blocks multiplied in place (a
    Q4_K_M-like mix, Q8_0 with a scaled rope, Qwen3's head norms), on 1 and 2 threads: byte for byte the host
    build's output."""
    compiler, flags, runner = target(name)
    runs = [("float32", 1), ("int8", 1), ("int4", 2), ("gguf-q4_k_m", 1), ("gguf-q8_0", 2), ("gguf-qwen3", 1)]
    if name not in ("x86-64", "aarch64"):  # the slow ones (fmaf calls; emulation) leave 2 threads to the others
        runs.append(("float32", 2))
    if name == "native":  # the host build itself (gcc, -march=native), whose 1-thread outputs these are
        driver, runs = dumps / "driver", [(kind, threads) for kind, threads in runs if threads > 1]
    else:
        driver = compile_driver(compiler, flags, tmp_path / "driver")
    for kind, threads in runs:
        assert run_driver(runner, driver, dumps / f"{kind}.dump", threads) == host_outputs[kind], (name, kind, threads)


@needs_compiler
@pytest.mark.skipif(not X86 or "fma" not in build.cpu_features().split(), reason="needs a CPU with FMA to fuse")
def test_a_compiler_that_fuses_despite_fp_contract_off_is_refused_and_torch_runs_with_a_notice(rope, tmp_path):
    """A $CC whose last word is -ffp-contract=fast (a wrapper, a distribution's default) would fuse the products
    the code writes unfused: the self-test's probe finds it, the library is deleted, torch runs, one notice."""
    run = generate_with_compiler(rope, tmp_path, after="-ffp-contract=fast")
    assert run.ok().json()["engine"] == "torch"
    # past the compile's line (a step over a second, told on a pipe as it runs): one notice
    (notice,) = [line for line in run.err.splitlines() if not line.startswith("compiling the native core")]
    assert "it fuses a multiply and an add" in notice, run.err
    assert not list((tmp_path / "cache" / "manas").glob("*.so"))


@needs_compiler
def test_json_records_carry_what_reproduces_them(rope, native_library):
    """The seed, the engine and, on the native one, the core's arithmetic version; torch has none to promise."""
    for engine, version in (("native", native_library.manas_arithmetic_version()), ("torch", None)):
        command = ("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "ab", "-n", "3", "--seed", "7", "--json")
        record = manas(*command, "--engine", engine).ok().json()
        assert (record["seed"], record["engine"], record["arithmetic_version"]) == (7, engine, version)
