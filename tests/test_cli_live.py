"""What a terminal shows while `manas generate` runs, and what must never change for pipes: the live status line
and sample regions on a pseudo-terminal (rendered with pyte, a terminal emulator), stdout byte for byte, the
notice when the window fills, JSON lines that survive any line splitter, and `manas --version`."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch

from cli_fixtures import MANAS, RUN_OPTIONS, cli_env, generate, manas  # noqa: F401
from manas_cli.checkpoint import save_checkpoint
from manas_cli.model import GPT, GPTConfig
from manas_cli.tokenizer import bpe_spec

# ---- JSON lines ---------------------------------------------------------------------------------------------------

# Characters that JSON allows raw inside a string but that str.splitlines() (and other splitters) take as line ends.
LINE_SEPARATORS = ("\u0085", "\u2028", "\u2029")


@pytest.fixture(scope="module")
def separators_checkpoint(tmp_path_factory):
    """A model that writes nothing but NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR: its BPE has a token for each,
    and its final LayerNorm (weight 0, bias v) makes every position's hidden state v, whose logits through the tied
    embedding are 20 for those three tokens and 0 for all others."""
    pieces = [character.encode("utf-8") for character in LINE_SEPARATORS]
    ranks = {bytes([i]): i for i in range(256)}
    for token in (b"\xe2\x80", *pieces):
        ranks[token] = len(ranks)
    config = GPTConfig(vocab_size=len(ranks) + 1, block_size=16, n_layer=1, n_head=2, n_embd=8)
    model = GPT(config).eval()
    hidden = torch.ones(config.n_embd)
    with torch.no_grad():
        model.final_norm.weight.zero_()
        model.final_norm.bias.copy_(hidden)
        model.token_embedding.weight.zero_()
        for piece in pieces:
            model.token_embedding.weight[ranks[piece]] = hidden * 20 / hidden.square().sum()
    path = tmp_path_factory.mktemp("separators") / "separators.safetensors"
    save_checkpoint(path, model, bpe_spec(ranks))
    return path


def test_generated_line_separators_stay_inside_one_json_line(separators_checkpoint):
    run = manas("generate", "-c", separators_checkpoint, *RUN_OPTIONS, "-p", "x", "-n", "30", "-t", "1",
                "--seed", "0", "--num-samples", "2", "--json").ok()
    lines = run.out.splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    for record in records:
        assert len(record["text"]) == 30
        assert set(record["text"]) == set(LINE_SEPARATORS)  # the test really produced all three
    text = manas("generate", "-c", separators_checkpoint, *RUN_OPTIONS, "-p", "x", "-n", "30", "-t", "1",
                 "--seed", "0", "--num-samples", "2").ok()
    assert text.out == "\n\n".join(record["text"] for record in records) + "\n"  # text mode writes them raw


def test_inspect_cache_json_stays_one_line_when_the_path_holds_a_line_separator(separators_checkpoint, tmp_path):
    odd = tmp_path / "model\u2028one\u0085two.safetensors"
    odd.write_bytes(separators_checkpoint.read_bytes())
    run = manas("inspect-cache", "-c", odd, *RUN_OPTIONS, "-p", "x", "--json").ok()
    (line,) = run.out.splitlines()
    assert json.loads(line)["checkpoint"] == str(odd)


# ---- --version ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_metadata_without_importing_torch(flag):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "manas_cli", flag], capture_output=True,
                          env=cli_env(), timeout=60)
    assert done.returncode == 0
    assert done.stdout.decode() == f"manas {version('manas')}\n"
    imported = [line.split("|")[-1].strip() for line in done.stderr.decode().splitlines()]
    assert "manas_cli.cli" in imported  # -X importtime really listed the imports
    assert not [name for name in imported if name.split(".")[0] == "torch"]
