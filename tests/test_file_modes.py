"""Every file and folder manas writes gets the mode a plain open() or mkdir() gives under the user's umask: neither
the private 0600 of a temporary file nor a mode of its own."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli, cli_env, learned, rope  # noqa: F401 (fixtures)
from test_hardening_writes import TINY_SHAPE, write_nanogpt

UMASK = 0o027  # neither 022 nor 077: a forced 0644, 0600 or 0755 all show


def run_under_umask(*args: str | Path) -> None:
    done = cli(*args, umask=UMASK)
    assert done.returncode == 0, done.stderr.decode()


def modes(paths: list[Path]) -> dict[str, int]:
    return {path.name: stat.S_IMODE(path.stat().st_mode) for path in paths}


@pytest.mark.parametrize(
    "command", ["convert", "quantize", "train", "train-tokenizer-only", "export-gguf", "export-hf"]
)
def test_written_files_take_the_umasks_mode(tmp_path, rope, learned, shakespeare, command):
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:20_000])
    out = tmp_path / "out"
    args = {
        "convert": ["convert", *write_nanogpt(tmp_path), "--out", out],
        "quantize": ["quantize", rope.path, "--out", out],
        "train": ["train", text, "--out", out, "--steps", "1", *TINY_SHAPE],
        "train-tokenizer-only": ["train", text, "--out", out, "--tokenizer-only", "--vocab-size", "300"],
        "export-gguf": ["export", rope.path, "--format", "gguf", "--out", out],
        "export-hf": ["export", learned.path, "--out", out],
    }[command]
    run_under_umask(*args)
    if command == "export-hf":
        assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~UMASK
        written = sorted(out.iterdir())
        assert "model.safetensors" in {p.name for p in written}
    else:
        written = [out]
    assert modes(written) == {path.name: 0o666 & ~UMASK for path in written}
