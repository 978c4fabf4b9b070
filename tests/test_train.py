"""`manas train`, run as a user runs it: a real subprocess on a real text, a checkpoint that loads and generates."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken.load
import torch

from conftest import engine_of
from manas_cli.engine.generation import generate
from manas_cli.engine.sampling import Sampler
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.formats.header import read_metadata
from manas_cli.formats.tokenizer import end_of_text_id

TINY_SHAPE = [
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
    "--position-encoding",
    "rope",
    "--vocab-size",
    "300",
    "--batch-size",
    "8",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "5",
    "--dropout",
    "0",
    "--device",
    "cpu",
    "--threads",
    "1",
]
EVAL_LINE = re.compile(r"^step (\d+)/(\d+)  train ([\d.]+)  val ([\d.]+) nats/token ([\d.]+) nats/char", re.M)


def manas(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    """The installed console script (python -m manas_cli where there is none), with no terminal attached."""
    script = Path(sys.executable).with_name("manas")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "manas_cli"]
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([*command, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def small_text(shakespeare, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text(shakespeare[:40_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(small_text, tmp_path_factory):
    """One tiny training run (a few seconds), shared by the tests that read its results."""
    folder = tmp_path_factory.mktemp("run")
    (folder / "tmp").mkdir()
    result = manas(
        "train",
        small_text,
        "--out",
        "tmp/x.safetensors",
        *TINY_SHAPE,
        "--steps",
        "40",
        "--eval-every",
        "20",
        cwd=folder,
    )
    return result, folder / "tmp" / "x.safetensors"


def test_train_writes_a_checkpoint_of_the_requested_shape(trained):
    result, path = trained
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # talk goes to stderr
    assert "on cpu, 1 thread\n" in result.stderr  # --threads 1, in the singular
    config = load_checkpoint(path).model.config
    assert (config.n_layer, config.n_head, config.n_kv_head, config.n_embd, config.block_size) == (1, 4, 2, 32, 16)
    assert (config.position_encoding, config.vocab_size) == ("rope", 300)
    assert list(path.parent.iterdir()) == [path]  # no temporary files left from the atomic saves


def test_trained_checkpoint_loads_and_generates_text(trained):
    _, path = trained
    checkpoint = load_checkpoint(path)
    assert checkpoint.tokenizer_spec["kind"] == "bpe"
    prompt = torch.tensor([checkpoint.encoding.encode_ordinary("ROMEO:")])
    sampler = Sampler(temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(0))
    steps = list(generate(engine_of(checkpoint.model), prompt, sampler, 40))  # 2.5 windows of 16: overflows too
    tokens = [step.tokens[0] for step in steps]
    assert len(tokens) == 40
    assert all(0 <= token < checkpoint.model.config.vocab_size for token in tokens)
    text = checkpoint.encoding.decode([t for t in tokens if t != end_of_text_id(checkpoint.encoding)])
    assert text.strip()  # 40 steps of training only learn letter and space frequencies, but not nothing


def test_validation_loss_goes_down_during_training(trained):
    result, path = trained
    evaluations = [
        (int(step), int(total), float(train), float(val), float(per_char))
        for step, total, train, val, per_char in EVAL_LINE.findall(result.stderr)
    ]
    assert [(step, total) for step, total, *_ in evaluations] == [(20, 40), (40, 40)], result.stderr
    (_, _, _, val_20, _), (_, _, _, val_40, per_char_40) = evaluations
    assert val_20 < math.log(300)  # below a uniform guess over the vocabulary
    assert val_40 < val_20
    assert 0 < per_char_40 < val_40  # a token covers more than one character
    training = json.loads(read_metadata(path)["training"])  # the best (here: the last) evaluation was saved
    assert training["step"] == 40
    assert training["val_loss"] == pytest.approx(val_40, abs=1e-4)


def test_resume_continues_from_the_saved_step_and_keeps_the_best_checkpoint(trained, small_text, tmp_path):
    _, path = trained
    resumed = tmp_path / "x.safetensors"
    resumed.write_bytes(path.read_bytes())
    result = manas(
        "train",
        small_text,
        "--out",
        resumed,
        *TINY_SHAPE,
        "--steps",
        "60",
        "--eval-every",
        "10",
        "--resume",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    steps = [int(step) for step, *_ in EVAL_LINE.findall(result.stderr)]
    assert steps == [50, 60]  # continued after step 40, not from the start
    training = json.loads(read_metadata(resumed)["training"])
    best_before = json.loads(read_metadata(path)["training"])["val_loss"]
    assert training["step"] in (40, 50, 60) and training["val_loss"] <= best_before
    assert load_checkpoint(resumed).model.config.n_layer == 1


def test_tokenizer_only_writes_a_loadable_tiktoken_file(small_text, tmp_path, monkeypatch):
    result = manas(
        "train", small_text, "--out", "bpe.tiktoken", "--tokenizer-only", "--vocab-size", "300", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "bpe.tiktoken"]  # no model was trained or saved
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    ranks = tiktoken.load.load_tiktoken_bpe(str(tmp_path / "bpe.tiktoken"))
    assert len(ranks) == 299
    assert all(ranks[bytes([byte])] == byte for byte in range(256))


def write_empty(folder: Path) -> Path:
    (folder / "empty.txt").write_text("")
    return folder / "empty.txt"


def write_short(folder: Path) -> Path:
    (folder / "short.txt").write_text("hello world, hello world.\n" * 3)
    return folder / "short.txt"


BAD_INPUTS = {
    "missing-file": (lambda folder, small: folder / "missing.txt", [], 1, "missing.txt does not exist"),
    "empty-file": (lambda folder, small: write_empty(folder), [], 1, "is empty"),
    "shorter-than-two-blocks": (lambda folder, small: write_short(folder), [], 1, "fewer than two blocks of 16"),
    "n-embd-not-divisible": (
        lambda folder, small: small,
        ["--n-embd", "30"],
        1,
        r"invalid model shape: n_embd \(30\) must be divisible by n_head \(4\)",
    ),
    "zero-steps": (lambda folder, small: small, ["--steps", "0"], 2, "--steps"),  # a usage error, found by typer
}


@pytest.mark.parametrize(("make_input", "extra", "exit_code", "message"), BAD_INPUTS.values(), ids=BAD_INPUTS)
def test_bad_input_gives_one_error_line_and_an_exit_code(make_input, extra, exit_code, message, small_text, tmp_path):
    text_file = make_input(tmp_path, small_text)
    result = manas("train", text_file, "--out", "x.safetensors", *TINY_SHAPE, "--steps", "2", *extra, cwd=tmp_path)
    assert result.returncode == exit_code
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "x.safetensors").exists()
