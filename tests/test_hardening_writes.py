"""What manas guarantees about the files it writes and the signals it gets, through the real CLI on files the tests
make: nothing is overwritten without --force (not even by a racing twin), a signal leaves no temporary file, a
diverging training keeps its last good checkpoint, and extreme flag values neither crash nor overwrite anything."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli_env, generate, learned, manas, rope  # noqa: F401 (fixtures)
from conftest import sample
from manas_cli.engine.sampling import Sampler
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.header import read_metadata
from manas_cli.formats.tokenizer import encode_ranks
from manas_cli.torch_engine.sampling import probabilities

TINY_SHAPE = (
    "--n-layer",
    "1",
    "--n-head",
    "4",
    "--n-kv-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--vocab-size",
    "300",
    "--batch-size",
    "4",
    "--warmup-steps",
    "1",
    "--dropout",
    "0",
    *RUN_OPTIONS,
)


def assert_one_error_line(run, code: int, *names: str) -> str:
    """Exit `code`, nothing on stdout, a single stderr line `error: ...` naming each of `names`, no traceback."""
    assert run.returncode == code, run.err
    assert run.stdout == b""
    (line,) = run.err.splitlines()
    assert line.startswith("error: ")
    for name in names:
        assert name in line, line
    return line


def temporary_files(folder: Path) -> list[str]:
    """Every writer's leftovers: ours (.NAME.RANDOM.tmp), safetensors' own (.tmpRANDOM), staging folders."""
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


@pytest.fixture(scope="module")
def text(shakespeare, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(shakespeare[:20_000], encoding="utf-8")
    return path


def write_nanogpt(folder: Path, n_layer: int = 1, n_embd: int = 32, vocab_size: int = 257) -> list[str | Path]:
    """A nanoGPT ckpt.pt (zero weights: their values do not matter here) and a byte-level .tiktoken file; the
    `manas convert` arguments that read them."""
    C = n_embd
    state = {"transformer.wte.weight": torch.zeros(vocab_size, C), "transformer.wpe.weight": torch.zeros(32, C)}
    shapes = {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}
    for i in range(n_layer):
        state |= {f"transformer.h.{i}.{norm}.weight": torch.ones(C) for norm in ("ln_1", "ln_2")}
        state |= {f"transformer.h.{i}.{name}.weight": torch.zeros(shape) for name, shape in shapes.items()}
    state["transformer.ln_f.weight"] = torch.ones(C)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    args = dict(n_layer=n_layer, n_head=4, n_embd=C, block_size=32, bias=False, vocab_size=vocab_size, dropout=0.0)
    torch.save({"model": state, "model_args": args}, folder / "ckpt.pt")
    (folder / "bytes.tiktoken").write_text(encode_ranks({bytes([i]): i for i in range(256)}), encoding="ascii")
    return [folder / "ckpt.pt", "--tokenizer-file", folder / "bytes.tiktoken"]


def start(*args: str | Path) -> subprocess.Popen:
    return subprocess.Popen([*MANAS, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())


def finish(process: subprocess.Popen):
    from cli_fixtures import Run

    stdout, stderr = process.communicate(timeout=300)
    return Run(tuple(map(str, process.args)), process.returncode, stdout, stderr)


# ---- 1. train never overwrites what it was not told to --------------------------------------------------------------


@pytest.mark.parametrize("mode", [(), ("--tokenizer-only",)], ids=["model", "tokenizer-only"])
def test_train_refuses_an_existing_out_without_force_or_resume(text, tmp_path, mode):
    out = tmp_path / "precious.safetensors"
    out.write_bytes(b"the user's own file")
    run = manas("train", text, "--out", out, *TINY_SHAPE, "--steps", "2", *mode)
    assert_one_error_line(run, 1, str(out), "--force")
    assert out.read_bytes() == b"the user's own file"
    assert temporary_files(tmp_path) == []


@pytest.mark.parametrize(
    ("spelling", "mode"), [("same path", ()), ("hard link", ("--tokenizer-only",)), ("other spelling", ())]
)
def test_train_refuses_its_own_training_text_as_out_even_with_force(tmp_path, shakespeare, mode, spelling):
    path = tmp_path / "text.txt"
    path.write_text(shakespeare[:20_000], encoding="utf-8")
    out = {
        "same path": path,
        "hard link": tmp_path / "link.txt",
        "other spelling": tmp_path / ".." / tmp_path.name / "text.txt",
    }[spelling]
    if spelling == "hard link":
        os.link(path, out)
    run = manas("train", path, "--out", out, *TINY_SHAPE, "--steps", "2", "--force", *mode)
    assert_one_error_line(run, 1, str(out), "is the input file")
    assert path.read_text(encoding="utf-8") == shakespeare[:20_000]


@pytest.mark.parametrize("mode", [(), ("--tokenizer-only",)], ids=["model", "tokenizer-only"])
def test_train_refuses_a_folder_as_out(text, tmp_path, mode):
    run = manas("train", text, "--out", tmp_path, *TINY_SHAPE, "--steps", "2", "--force", *mode)
    assert_one_error_line(run, 1, str(tmp_path), "is a folder")
    assert list(tmp_path.iterdir()) == []


def test_train_force_replaces_an_existing_out_and_later_saves_replace_their_own(text, tmp_path):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"an older file")
    run = manas("train", text, "--out", out, *TINY_SHAPE, "--steps", "4", "--eval-every", "2", "--force")
    assert run.returncode == 0, run.err
    assert run.err.count("saved") >= 1 and run.err.splitlines()[-1] == f"best checkpoint: {out}"
    assert load_checkpoint(out).model.config.n_layer == 1
    assert temporary_files(tmp_path) == []
    ranks = tmp_path / "bpe.tiktoken"
    ranks.write_bytes(b"old ranks")
    manas("train", text, "--out", ranks, "--tokenizer-only", "--vocab-size", "300", "--force").ok()
    assert ranks.read_bytes() != b"old ranks" and len(ranks.read_text().splitlines()) == 299


# ---- 2. no-overwrite without a race -------------------------------------------------------------------------------


def test_racing_converts_without_force_one_wins_and_the_other_fails_cleanly(tmp_path):
    source = write_nanogpt(tmp_path, n_layer=4, n_embd=256)  # ~13 MB: both runs are mid-work together
    out = tmp_path / "out.safetensors"
    runs = [finish(p) for p in [start("convert", *source, "--out", out) for _ in range(2)]]
    assert sorted(run.returncode for run in runs) == [0, 1], [run.err for run in runs]
    loser = next(run for run in runs if run.returncode == 1)
    assert_one_error_line(loser, 1, str(out), "--force")
    assert load_checkpoint(out).model.config.n_embd == 256  # the winner's file, whole
    assert temporary_files(tmp_path) == []


def test_racing_exports_without_force_one_wins_and_the_other_fails_cleanly(learned, tmp_path):
    out = tmp_path / "hf"
    runs = [finish(p) for p in [start("export", learned.path, "--out", out) for _ in range(2)]]
    assert sorted(run.returncode for run in runs) == [0, 1], [run.err for run in runs]
    assert_one_error_line(next(run for run in runs if run.returncode == 1), 1, str(out))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert temporary_files(tmp_path) == []


def test_export_into_a_folder_someone_filled_is_refused_without_force(learned, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert_one_error_line(manas("export", learned.path, "--out", out), 1, str(out), "--force")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


# ---- 3. SIGTERM: like Ctrl-C, nothing left behind ------------------------------------------------------------------


def signal_when(process: subprocess.Popen, folder: Path, ready) -> bool:
    """Send SIGTERM as soon as ready(temporary files) holds; False if the process ended first."""
    while process.poll() is None:
        names = [folder / name for name in temporary_files(folder)]
        if names and ready(names):
            process.send_signal(signal.SIGTERM)
            return True
        time.sleep(0.001)
    return False


def sizes(paths: list[Path]) -> int:
    try:
        return sum(path.stat().st_size for path in paths)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> list:
    """A nanoGPT checkpoint of ~150 MB: its save takes long enough to be interrupted."""
    return write_nanogpt(tmp_path_factory.mktemp("big"), n_layer=12, n_embd=512)


# When the temporary file appears (safetensors is serializing), and once bytes are being written to it.
MOMENTS = {"serializing": lambda paths: True, "writing": lambda paths: sizes(paths) > 0}


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigterm_during_a_save_leaves_no_temporary_file_and_exits_143(big_source, tmp_path, moment):
    out = tmp_path / "out.safetensors"
    for _ in range(3):  # a busy machine may finish the save before the test sees it begin: try again
        process = start("convert", *big_source, "--out", out)
        signalled = signal_when(process, tmp_path, MOMENTS[moment])
        run = finish(process)
        if signalled and run.returncode != 0:
            break
        out.unlink(missing_ok=True)
    else:
        pytest.fail("the save was never caught in progress")
    assert_one_error_line(run, 143, "terminated")
    assert temporary_files(tmp_path) == []
    assert not out.exists() or load_checkpoint(out).model.config.n_layer == 12  # whole or not at all


def test_sigterm_keeps_the_generated_text_like_ctrl_c_and_exits_143(rope):
    process = subprocess.Popen(
        [*MANAS, "generate", "-c", str(rope.path), *RUN_OPTIONS, "-p", "ROMEO:", "-n", "100000", "-t", "0"],
        bufsize=0,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    first = process.stdout.read(1)  # generation has begun
    process.send_signal(signal.SIGTERM)
    rest, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    assert b"Traceback" not in stderr and b"error" not in stderr
    printed = (first + rest).decode()
    assert printed.endswith("\n") and len(printed) > 1


# ---- 4. a diverging training stops and keeps the last good checkpoint --------------------------------------------


def test_training_with_a_learning_rate_that_diverges_stops_with_one_error_and_writes_nothing(text, tmp_path):
    out = tmp_path / "model.safetensors"
    run = manas("train", text, "--out", out, *TINY_SHAPE, "--steps", "6", "--eval-every", "2", "--lr", "1e38")
    assert run.returncode == 1 and "Traceback" not in run.err
    errors = [line for line in run.err.splitlines() if line.startswith("error: ")]
    assert errors == [run.err.splitlines()[-1]] and "nan" in errors[0] and "--lr" in errors[0], run.err
    assert "best checkpoint:" not in run.err
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_training_that_diverges_keeps_the_last_good_checkpoint(text, tmp_path):
    out = tmp_path / "model.safetensors"
    manas("train", text, "--out", out, *TINY_SHAPE, "--steps", "2", "--eval-every", "2").ok()
    good = out.read_bytes()
    run = manas(
        "train", text, "--out", out, *TINY_SHAPE, "--steps", "8", "--eval-every", "2", "--lr", "1e38", "--resume"
    )
    assert run.returncode == 1, run.err
    assert run.err.splitlines()[-1].startswith("error: ") and "of step 2" in run.err.splitlines()[-1]
    assert "best checkpoint:" not in run.err
    assert out.read_bytes() == good and temporary_files(tmp_path) == []


# ---- 9. temperatures and top-p too small for float32 ----------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ("-t", "1e-38"),
        ("-t", "1e-45"),
        ("-t", "1e-320"),
        ("--top-p", "1e-50"),
        ("-t", "1e-45", "--top-k", "3", "--top-p", "1e-50"),
    ],
)
def test_tiny_temperature_or_top_p_generates_the_greedy_text(rope, flags):
    greedy = generate(rope, "-p", "ROMEO:", "-n", "12", "-t", "0").ok()
    run = generate(rope, "-p", "ROMEO:", "-n", "12", "--seed", "3", *flags).ok()
    assert run.out == greedy.out and run.err == ""


def test_a_temperature_too_small_to_divide_by_is_greedy_row_by_row():
    logits = torch.tensor([[1e-39, 3e-39, 2e-39], [1.0, -2.0, 3.0]])  # / 1e-38: [0.1, 0.3, 0.2] and an overflow
    probs = probabilities(Sampler(temperature=1e-38), logits)
    torch.testing.assert_close(probs[0], torch.softmax(torch.tensor([0.1, 0.3, 0.2]), -1))
    assert probs[1].tolist() == [0.0, 0.0, 1.0]
    sampler = Sampler(temperature=1e-45, generator=torch.Generator().manual_seed(0))
    assert (
        sample(sampler, torch.randn(64, 50, generator=torch.Generator().manual_seed(1)).mul(30)).squeeze(1).tolist()
        == torch.randn(64, 50, generator=torch.Generator().manual_seed(1)).argmax(-1).tolist()
    )


def test_a_top_p_below_the_top_probability_keeps_the_top_token():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 4.9, 0.0]])
    for top_p in (1e-50, 1e-8, 0.1):
        probs = probabilities(Sampler(temperature=1.0, top_p=top_p), logits)
        assert (probs > 0).sum(-1).tolist() == [1, 1] and probs.argmax(-1).tolist() == [1, 0]


# ---- 10. --seed has a range ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["-1", str(2**64), "1180591620717411303424", "-1180591620717411303424"])
@pytest.mark.parametrize("command", ["generate", "train"])
def test_a_seed_outside_0_to_2_64_is_a_usage_error_naming_the_range(rope, text, tmp_path, command, seed):
    args = ("-c", rope.path, "-p", "x") if command == "generate" else (text, "--out", tmp_path / "m.safetensors")
    assert_one_error_line(manas(command, *args, "--seed", seed), 2, "--seed", "0 <= seed < 2^64")


def test_the_largest_seed_is_accepted_and_the_range_is_in_the_help(rope):
    generate(rope, "-p", "ROMEO:", "-n", "3", "--seed", str(2**64 - 1)).ok()
    for command in ("generate", "train"):
        assert "0 <= seed < 2^64" in " ".join(manas(command, "--help", COLUMNS="300").ok().out.split())


# ---- 16. one clear error line --------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [("generate", "-p", "x"), ("bench",), ("inspect-cache",)], ids=lambda c: c[0])
def test_a_closed_stdout_is_refused_before_loading_the_model(tmp_path, command):
    # The checkpoint does not exist: had the model been loaded first, the error would name it instead.
    done = subprocess.run(
        [*MANAS, *command, "-c", str(tmp_path / "missing.safetensors")],
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),
        env=cli_env(),
        timeout=120,
    )
    (line,) = done.stderr.decode().splitlines()
    assert done.returncode == 1 and line.startswith("error: standard output is closed")


@pytest.mark.parametrize("what", ["folder", "fifo"])
def test_a_folder_or_fifo_as_checkpoint_gets_one_error_line_and_never_blocks(tmp_path, what):
    path = tmp_path / "model.safetensors"
    path.mkdir() if what == "folder" else os.mkfifo(path)
    line = assert_one_error_line(manas("generate", "-c", path, *RUN_OPTIONS, "-p", "x"), 1, str(path))
    assert ("is a folder" if what == "folder" else "not a regular file") in line


@pytest.mark.parametrize(
    "training",
    [
        "{not json",
        "[1, 2]",
        '{"step": "ten"}',
        '{"step": -1}',
        '{"step": 2, "val_loss": NaN}',
        '{"step": 2, "val_loss": true}',
    ],
)
def test_resume_from_garbled_training_metadata_gets_one_error_line(rope, text, tmp_path, training):
    out = tmp_path / "model.safetensors"
    checkpoint = load_checkpoint(rope.path)
    save_checkpoint(out, checkpoint.model, checkpoint.tokenizer_spec, {"training": training})
    assert read_metadata(out)["training"] == training
    run = manas("train", text, "--out", out, *RUN_OPTIONS, "--steps", "4", "--resume")
    assert_one_error_line(run, 1, str(out), "training metadata", "--resume")
