"""A Hugging Face GPT-2 folder's own tokenizer files (vocab.json, merges.txt) stand for GPT-2's .tiktoken ranks:
convert reads them by itself, and `manas tokenizer` writes them as a .tiktoken file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_fixtures import DATA, checkpoints, learned, manas, rope  # noqa: F401 (fixtures)
from manas_cli.errors import TokenizerError
from manas_cli.formats.huggingface import tokenizer_files
from manas_cli.formats.tokenizer import build_encoding, spec_from_hf_files, spec_from_tiktoken_file


@pytest.fixture(scope="module")
def gpt2_files() -> dict[str, str]:
    """GPT-2's vocab.json and merges.txt, as manas' export writes them from GPT-2's ranks (byte for byte OpenAI's)."""
    encoding = build_encoding(spec_from_tiktoken_file(DATA / "gpt2.tiktoken"))
    return tokenizer_files(encoding, 1024, DATA / "gpt2.tiktoken")


def test_gpt2s_vocab_and_merges_give_tiktokens_gpt2_ranks_and_ids(gpt2_files):
    ranks = spec_from_tiktoken_file(DATA / "gpt2.tiktoken")
    spec = spec_from_hf_files(gpt2_files["vocab.json"], gpt2_files["merges.txt"], "gpt2")
    assert spec["ranks"] == ranks["ranks"] and spec["special_tokens"] == {"<|endoftext|>": 50256}
    corpus = (DATA / "tinyshakespeare-head.txt").read_text(encoding="utf-8")[:50_000] + " café 日本 🎉 \n\n  x"
    assert build_encoding(spec).encode_ordinary(corpus) == build_encoding(ranks).encode_ordinary(corpus)


def test_merges_out_of_id_order_are_refused_naming_the_line(gpt2_files):
    merges = gpt2_files["merges.txt"].splitlines()
    merges[1], merges[2] = merges[2], merges[1]
    with pytest.raises(TokenizerError, match="line 3 of merges.txt builds"):
        spec_from_hf_files(gpt2_files["vocab.json"], "\n".join(merges), "gpt2")


def test_a_token_no_merge_builds_is_a_special_token_and_bytes_without_a_token_are_dropped(tmp_path):
    """A vocabulary of the 94 printable ASCII bytes alone, as Hugging Face runs it: a byte without a token (a space,
    é's two bytes) is dropped from the ids (real vocabularies lack some: SmolLM2's lacks 21)."""
    from manas_cli.formats.tokenizer import build_encoding, encode_text

    vocab = {chr(c): i for i, c in enumerate(range(ord("!"), ord("~") + 1))}
    spec = spec_from_hf_files(json.dumps(vocab | {"<|x|>": 94}), "#version: 0.2\n", "tiny")
    assert spec["special_tokens"] == {"<|x|>": 94} and spec["unknown_bytes"] == "skip"
    assert encode_text(build_encoding(spec), "a bé<|x|>", special=True) == [vocab["a"], vocab["b"], 94]


@pytest.fixture(scope="module")
def gpt2_folder(learned, tmp_path_factory) -> Path:
    """The learned tiny model exported as a Hugging Face GPT-2 folder, with its vocab.json and merges.txt."""
    folder = tmp_path_factory.mktemp("hf") / "gpt2"
    manas("export", learned.path, "--out", folder).ok()
    return folder


def test_convert_reads_a_gpt2_folders_own_tokenizer(tmp_path, learned, gpt2_folder):
    folder = gpt2_folder
    back = tmp_path / "back.safetensors"
    run = manas("convert", folder, "--out", back).ok()
    assert "vocab.json and merges.txt" in run.err
    original = manas(
        "generate", "-c", learned.path, "--threads", "1", "-p", "ROMEO:", "-n", "12", "-t", "0", "--json"
    ).ok()
    converted = manas("generate", "-c", back, "--threads", "1", "-p", "ROMEO:", "-n", "12", "-t", "0", "--json").ok()
    assert converted.json()["tokens"] == original.json()["tokens"]


def test_manas_tokenizer_writes_the_folders_ranks_as_a_tiktoken_file(tmp_path, learned, gpt2_folder):
    folder = gpt2_folder
    out = tmp_path / "tiny.tiktoken"
    manas("tokenizer", folder, "--out", out).ok()
    assert out.read_text() == embedded_tokenizer(learned.path)["ranks"]
    refused = manas("tokenizer", folder, "--out", out, fresh=True)
    assert refused.returncode == 1 and "exists: pass --force" in refused.err


def embedded_tokenizer(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()["tokenizer"])
