"""The harness the CLI tests stand on: a run forked from tests/cli_zygote.py is the run a fresh interpreter makes
(its output, its errors, its exit status, its stdin), or the suite would be testing something else."""

from __future__ import annotations

import json
import os

import pytest

from cli_fixtures import RUN_OPTIONS, checkpoints, cli_env, rope, run_cli  # noqa: F401 (fixtures)

TIMINGS = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s")  # a run's speed, not its result


def both(args: tuple[str, ...], stdin: bytes = b"", **env: str) -> tuple[tuple, tuple]:
    """(returncode, stdout, stderr) of the run forked from the zygote, then of a fresh interpreter."""
    environment = cli_env(**env)
    forked = run_cli(args, stdin, environment)
    fresh = run_cli(args, stdin, environment, fork=False)
    return forked, fresh


def without_timings(stdout: bytes) -> list[dict]:
    """The records without their speed, and without the seed a run draws where none is given."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS + ("seed",)} for line in stdout.splitlines()]


@pytest.mark.parametrize(
    "args",
    [("--version",), ("generate", "--help"), ("bogus",), ("generate", "-c", "/nonexistent.safetensors", "-p", "a")],
    ids=["version", "help", "unknown-command", "missing-checkpoint"],
)
def test_a_forked_run_prints_and_exits_as_a_fresh_one(args):
    forked, fresh = both(args)
    assert forked == fresh


def test_a_forked_run_reads_its_stdin_and_generates_as_a_fresh_one(rope):
    lines = b'{"prompt": "ROMEO:", "seed": 3, "max_tokens": 5}\n{"prompt": "", "temperature": 0}\n'
    forked, fresh = both(("generate", "-c", str(rope.path), *RUN_OPTIONS, "--jsonl"), stdin=lines)
    assert forked[0] == fresh[0] == 0 and forked[2] == fresh[2]
    assert without_timings(forked[1]) == without_timings(fresh[1]) and len(without_timings(forked[1])) == 2


def test_a_forked_run_takes_its_environment_and_folder(tmp_path, rope, monkeypatch):
    """$MANAS_CHECKPOINT picks the model, read at run time from the run's own environment; --out is relative."""
    monkeypatch.chdir(tmp_path)
    args = ("generate", *RUN_OPTIONS, "-p", "ab", "-n", "3", "-t", "0", "--json")
    forked, fresh = both(args, MANAS_CHECKPOINT=str(rope.path))
    assert forked[0] == fresh[0] == 0 and without_timings(forked[1]) == without_timings(fresh[1])
    again = run_cli(args, b"", cli_env(MANAS_CHECKPOINT=str(rope.path)))
    assert json.loads(again[1])["seed"] != json.loads(forked[1])["seed"]  # each fork draws its own
    assert run_cli(("quantize", str(rope.path), "--out", "q.safetensors"), b"", cli_env())[0] == 0
    assert (tmp_path / "q.safetensors").exists() and os.getcwd() == str(tmp_path)
