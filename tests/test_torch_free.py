"""The CPU path without torch (issue 26): the commands never import it on the native engine, the core reads the
mapped checkpoint itself (equal to the torch loader's tensors, whatever their stored type or alignment), and the
core's sampler keeps the torch sampler's rules with a counter-based generator."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli_env, rope  # noqa: F401 (fixtures)
from conftest import all_logits, logits_view, make_model, native_model, needs_compiler
from manas_cli.engine.sampling import Penalties, Sampler
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.header import open_checkpoint
from manas_cli.native.model import Logits
from manas_cli.native.sampling import NativeSampling
from manas_cli.torch_engine.sampling import adjust, probabilities, top_logprobs

pytestmark = needs_compiler

# Runs the CLI in this interpreter, then says on stderr's last line whether torch was ever imported.
PROBE = """
import runpy, sys
sys.argv = ["manas", *sys.argv[1:]]
try:
    runpy.run_module("manas_cli", run_name="__main__")
finally:
    print("torch imported" if "torch" in sys.modules else "torch never imported", file=sys.stderr)
"""


def probe(*args, stdin: str = "") -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)],
        input=stdin.encode(),
        capture_output=True,
        env=cli_env(),
        timeout=300,
    )
    return done.returncode, done.stderr.decode().strip().splitlines()[-1]


@pytest.mark.parametrize(
    "command, stdin",
    [
        (["generate", "-p", "ROMEO:", "-n", "5", "-t", "0"], ""),
        (
            [
                "generate",
                "-p",
                "ROMEO:",
                "-n",
                "5",
                "--seed",
                "1",
                "--top-p",
                "0.9",
                "--top-k",
                "20",
                "--min-p",
                "0.01",
                "--repetition-penalty",
                "1.2",
                "--frequency-penalty",
                "0.3",
                "--presence-penalty",
                "0.2",
                "--logprobs",
                "2",
                "--num-samples",
                "2",
                "--json",
            ],
            "",
        ),
        (["generate", "--jsonl"], '{"prompt": "ROMEO:", "max_tokens": 3}\n{"prompt": "JULIET:", "max_tokens": 4}\n'),
        (["generate", "-p", "ROMEO:", "-n", "6", "--json-schema", '{"type": "object"}'], ""),
        (["score"], "ROMEO: what light through yonder window breaks? It is the east."),
        (["bench", "-n", "4", "--prompt-tokens", "4", "-r", "1"], ""),
        (["inspect-cache", "--tokens", "2", "--json"], ""),
    ],
    ids=["generate", "generate-sampled", "jsonl", "structured", "score", "bench", "inspect-cache"],
)
def test_the_native_path_of_each_command_never_imports_torch(rope, command, stdin):
    code, last = probe(*command, "-c", rope.path, *RUN_OPTIONS, stdin=stdin)
    assert (code, last) == (0, "torch never imported")


@pytest.mark.parametrize("flags", [["--engine", "torch"], ["--quantize", "int8"], ["--dtype", "bfloat16"]])
def test_torch_loads_where_it_is_needed(rope, flags):
    assert probe("generate", "-p", "ROMEO:", "-n", "3", "-t", "0", "-c", rope.path, *RUN_OPTIONS, *flags) == (
        0,
        "torch imported",
    )


def test_importtime_shows_no_torch_on_the_native_path(rope):
    done = subprocess.run(
        [*MANAS, "generate", "-p", "ROMEO:", "-n", "3", "-t", "0", "-c", rope.path, *RUN_OPTIONS],
        capture_output=True,
        env={**cli_env(), "PYTHONPROFILEIMPORTTIME": "1"},
        timeout=300,
    )
    modules = [
        line.split("|")[-1].strip() for line in done.stderr.decode().splitlines() if line.startswith("import time")
    ]
    assert done.returncode == 0 and "manas_cli.native.engine" in modules
    assert not [module for module in modules if module.split(".")[0] in ("torch", "numpy", "safetensors")]


# ---- the loader: the mapped file as the core reads it equals the torch loader's tensors -----------------------------


def logits_of(model, ids: list[list[int]]) -> torch.Tensor:
    return all_logits(model, torch.tensor(ids)).view(-1, model.config.vocab_size)


@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_the_core_on_the_mapped_file_equals_the_core_on_the_torch_loaded_model(
    tmp_path, native_library, weights, tiny_bpe_spec
):
    """Format 2's token embedding is the output layer's codes: the core dequantizes its rows as the torch loader
    does (a float table there), and every other tensor is the file's own bytes."""
    path = tmp_path / f"{weights}.safetensors"
    model = make_model("learned", "gqa", bias=True)
    if weights != "float32":
        from manas_cli.torch_engine.quantize import quantize_model

        quantize_model(model, weights)
    save_checkpoint(path, model, tiny_bpe_spec)
    ids = [[1, 5, 9, 33, 2, 7], [3, 3, 3, 8, 200, 12]]
    mapped = native_model(open_checkpoint(path), native_library)
    loaded = native_model(load_checkpoint(path).model, native_library)
    assert torch.equal(logits_of(mapped, ids), logits_of(loaded, ids))


def write_unaligned(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """A safetensors file whose header length is odd, so that no tensor's data starts on a 4-byte boundary (the
    format allows it; safetensors' own writer pads the header to 8)."""
    aligned = save(tensors, metadata=metadata)
    length = int.from_bytes(aligned[:8], "little")
    header = aligned[8 : 8 + length].rstrip(b" ")
    header += b" " * ((5 - len(header)) % 8)  # 8 + length ≡ 5 (mod 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + aligned[8 + length :])
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_file_of_any_float_type_or_alignment_runs_as_its_float32_values(
    tmp_path, native_library, dtype, tiny_bpe_spec
):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, make_model("rope", "mqa"), tiny_bpe_spec)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        tensors = {name: f.get_tensor(name).to(dtype) for name in f.keys()}
        metadata = f.metadata()
    odd = write_unaligned(tmp_path / "odd.safetensors", tensors, metadata)
    assert open_checkpoint(odd).header.tensors["final_norm.weight"].start % 4 != 0
    ids = [[4, 8, 15, 16, 23, 42]]
    as_float32 = load_checkpoint(odd, dtype=torch.float32).model  # torch casts at load, as the CLI asks it to
    core = logits_of(native_model(open_checkpoint(odd), native_library), ids)
    assert torch.equal(core, logits_of(native_model(as_float32, native_library), ids))
    assert (core - logits_of(as_float32, ids)).abs().max() < 1e-4


# ---- the sampler -------------------------------------------------------------------------------------------------

VOCAB = 300


@pytest.fixture(scope="module")
def tiny_native(native_library):
    return native_model(make_model("rope", "gqa"), native_library)


def core_draws(
    native,
    sampler: Sampler,
    rows: torch.Tensor,
    windows: list[list[int]],
    position: int = 0,
    logprobs: int = 0,
    state: NativeSampling | None = None,
):
    state = state or NativeSampling(native, sampler, rows.size(0), logprobs)
    logits = Logits(rows.size(0), rows.size(1))
    logits_view(logits).copy_(rows)
    return state.sample(logits, windows, position)


def random_logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_the_argmax_of_the_decodable_ids(tiny_native):
    logits = random_logits(8)
    decodable = [True] * 250 + [False] * 10 + [True] * 30  # a hole, and ids past the tokenizer's end
    logits[:, 250:260] = 100.0
    sampler = Sampler(temperature=0.0, decodable=decodable[:280])
    tokens, _ = core_draws(tiny_native, sampler, logits, [[1]] * 8)
    expected = adjust(sampler, logits).argmax(-1).tolist()
    assert tokens == expected and not any(250 <= t < 260 or t >= 280 for t in tokens)


@pytest.mark.parametrize(
    "penalties",
    [Penalties(), Penalties(repetition=1.3, last_n=3), Penalties(repetition=0.7, last_n=-1)],
    ids=["none", "repetition-last-3", "repetition-whole-window"],
)
def test_logprobs_are_torchs_over_the_same_adjusted_logits(tiny_native, penalties):
    logits = random_logits(3, seed=1)
    windows = [[5, 6, 7, 5, 9], [1, 2, 3, 4, 250], [0, 0, 0, 0, 299]]
    sampler = Sampler(temperature=0.0, penalties=penalties)
    tokens, top = core_draws(tiny_native, sampler, logits, windows, logprobs=5)
    adjusted = adjust(sampler, logits, torch.tensor(windows))
    expected = top_logprobs(adjusted, torch.tensor(tokens)[:, None], 5)
    for (logprob, ids, values), (want, want_ids, want_values) in zip(top, expected):
        assert ids == want_ids and abs(logprob - want) < 1e-5
        assert max(abs(a - b) for a, b in zip(values, want_values)) < 1e-5


def test_frequency_and_presence_penalties_count_the_rows_own_tokens(tiny_native):
    logits = random_logits(2, seed=2)
    sampler = Sampler(temperature=0.0, penalties=Penalties(frequency=1.5, presence=0.5))
    state = NativeSampling(tiny_native, sampler, 2, 3)
    first, _ = core_draws(tiny_native, sampler, logits, [[1], [1]], state=state)
    second, top = core_draws(tiny_native, sampler, logits, [[1], [1]], state=state)
    counts = torch.zeros(2, VOCAB).scatter_(1, torch.tensor(first)[:, None], 1.0)
    adjusted = adjust(sampler, logits, None, counts)
    assert second == adjusted.argmax(-1).tolist() and second != first
    assert [t[1] for t in top] == [t[1] for t in top_logprobs(adjusted, torch.tensor(second)[:, None], 3)]


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, top_p=0.995),  # keeps most ids: the core sorts them block after block (64, 256, ...)
        dict(temperature=1.3, min_p=0.05),
        dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
    ],
    ids=["temperature", "top-k", "top-p", "top-p-past-blocks", "min-p", "all"],
)
def test_draws_follow_torchs_filtered_distribution(tiny_native, options):
    """4,000 draws of one row (positions 0..3,999 of the counter) against the probabilities torch's sampler
    computes: nothing it filters out is drawn, and each token's frequency is within 0.03 of its probability."""
    logits = random_logits(1, seed=3, scale=1.5)
    sampler = Sampler(**options, seed=11)
    state = NativeSampling(tiny_native, sampler, 1, 0)
    draws = [core_draws(tiny_native, sampler, logits, [[1]], position, state=state)[0][0] for position in range(4000)]
    expected = probabilities(sampler, logits)[0]
    frequencies = torch.bincount(torch.tensor(draws), minlength=VOCAB).double() / len(draws)
    assert all(expected[token] > 0 for token in set(draws))
    assert (frequencies - expected.double()).abs().max() < 0.03


def test_a_draw_depends_on_seed_row_and_position_only(tiny_native):
    logits = random_logits(1, seed=4, scale=0.5).repeat(3, 1)  # three rows with the same logits
    sampler = Sampler(temperature=1.0, seed=7)
    together, _ = core_draws(tiny_native, sampler, logits, [[1]] * 3, position=10)
    again, _ = core_draws(tiny_native, sampler, logits, [[1]] * 3, position=10)
    alone, _ = core_draws(tiny_native, sampler, logits[:1], [[1]], position=10)
    assert together == again and together[0] == alone[0]
    later = [core_draws(tiny_native, sampler, logits[:1], [[1]], position=p)[0][0] for p in range(11, 40)]
    other_seed = [
        core_draws(tiny_native, Sampler(temperature=1.0, seed=8), logits[:1], [[1]], position=p)[0][0]
        for p in range(11, 40)
    ]
    assert len(set(later)) > 5 and later != other_seed


# Random123's known-answer tests for Philox4x32-10 (kat_vectors): counter, key, the four words out.
PHILOX_VECTORS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_VECTORS)
def test_the_generator_is_philox_4x32_10(native_library, counter, key, expected):
    out = (ctypes.c_uint32 * 4)()
    native_library.manas_philox((ctypes.c_uint32 * 4)(*counter), (ctypes.c_uint32 * 2)(*key), out)
    assert tuple(out) == expected


def test_logprobs_beyond_the_drawable_ids_name_each_of_them_once(tiny_native):
    """Twenty alternatives asked of six drawable ids: the six, never a padding of id 0."""
    sampler = Sampler(temperature=0.0, decodable=[True] * 6)
    rows = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    _, [(_, ids, logprobs)] = core_draws(tiny_native, sampler, rows, [[1]], logprobs=20)
    assert sorted(ids) == list(range(6)) and len(logprobs) == 6


def test_uniform_numbers_are_in_the_unit_interval_and_spread(native_library):
    numbers = [native_library.manas_uniform(2**64 - 1, row, position) for row in range(4) for position in range(500)]
    assert all(0.0 <= u < 1.0 for u in numbers) and len(set(numbers)) == len(numbers)
    assert abs(sum(numbers) / len(numbers) - 0.5) < 0.02


def test_a_seeded_sample_is_the_same_alone_or_beside_others(rope):
    """Row 0 of --num-samples 3 draws with row 0's numbers, as one sample does: batching never changes a text."""

    def texts(*args: str) -> list[str]:
        done = subprocess.run(
            [
                *MANAS,
                "generate",
                "-c",
                rope.path,
                *RUN_OPTIONS,
                "-p",
                "ROMEO:",
                "-n",
                "24",
                "--seed",
                "5",
                "-t",
                "1.0",
                "--json",
                *args,
            ],
            capture_output=True,
            env=cli_env(),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr.decode()
        return [json.loads(line)["text"] for line in done.stdout.decode().splitlines()]

    three = texts("--num-samples", "3")
    assert three[0] == texts()[0] and len(set(three)) > 1


def test_serve_on_the_native_engine_never_imports_torch(rope):
    server = subprocess.Popen(
        [*MANAS, "serve", "-c", str(rope.path), *RUN_OPTIONS, "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**cli_env(), "PYTHONPROFILEIMPORTTIME": "1"},
    )
    lines = []
    for line in server.stderr:  # the import lines, then the ready line
        lines.append(line)
        if line.startswith("manas serve:"):
            break
    server.send_signal(2)
    lines += server.stderr.readlines()
    assert server.wait(timeout=60) == 0 and any(
        line.startswith("manas serve:") and "native engine" in line for line in lines
    )
    modules = [line.split("|")[-1].strip() for line in lines if line.startswith("import time")]
    assert modules and not [module for module in modules if module.split(".")[0] == "torch"]


def test_convert_refuses_a_source_config_or_output_without_importing_torch(tmp_path):
    """What convert checks before the weights (the source, the output, the config, the tokenizer) answers in a fifth
    of a second: torch is imported for the weights alone. (The refusals' words are tests/test_convert.py's.)"""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')  # lacks the shape
    (folder / "model.safetensors").write_bytes(b"")
    (tmp_path / "taken.safetensors").write_bytes(b"x")
    for source, out in (
        (folder, tmp_path / "out.safetensors"),
        (tmp_path / "absent", tmp_path / "out.safetensors"),
        (folder, tmp_path / "taken.safetensors"),
    ):
        assert probe("convert", source, "--out", out) == (1, "torch never imported"), (source, out)
    assert not (tmp_path / "out.safetensors").exists() and (tmp_path / "taken.safetensors").read_bytes() == b"x"


def test_a_folder_whose_tokenizer_does_not_fit_is_refused_with_its_weights_unread(tmp_path, tiny_bpe_spec):
    """convert reads a folder's weights a layer at a time, after the tokenizer is checked: 268 tokens for a model of
    100 ids is refused before torch is imported."""
    from test_llama_family import hf_folder

    hf_folder(tmp_path / "hf", tiny_bpe_spec, "smollm2", vocab_size=100)
    assert probe("convert", tmp_path / "hf", "--out", tmp_path / "out.safetensors") == (1, "torch never imported")
    assert not (tmp_path / "out.safetensors").exists()
