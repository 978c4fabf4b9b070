"""Tokenizers from a checkpoint's description, the .tiktoken ranks format, and the streaming decoder."""

from __future__ import annotations

import pytest

from manas_cli.errors import TokenizerError
from manas_cli.formats.tokenizer import (
    IncrementalDecoder,
    bpe_spec,
    build_encoding,
    decode_ranks,
    encode_ranks,
    encode_text,
    end_of_text_id,
    spec_from_tiktoken_file,
    vocabulary_size,
)


@pytest.fixture(scope="module")
def encoding(tiny_bpe_spec):
    return build_encoding(tiny_bpe_spec)


def test_embedded_bpe_builds_an_encoding_with_end_of_text_after_the_last_rank(tiny_bpe_spec, encoding):
    ranks = decode_ranks(tiny_bpe_spec["ranks"])
    assert end_of_text_id(encoding) == len(ranks) == 267
    assert vocabulary_size(encoding) == 268
    assert encoding.encode("a<|endoftext|>", allowed_special="all") == [ord("a"), 267]
    assert encoding.encode_ordinary(" the") == [ranks[b" the"]]


def test_ranks_file_format_round_trips():
    ranks = {bytes([i]): i for i in range(256)} | {b"\x00\xff": 256, b" the": 257, "é".encode(): 258}
    text = encode_ranks(ranks)
    assert text.splitlines()[257] == "IHRoZQ== 257"  # base64(b" the"), one token per line, by rank
    assert decode_ranks(text) == ranks


def test_gpt2_ranks_file_reproduces_gpt2_token_ids(test_data):
    encoding = build_encoding(spec_from_tiktoken_file(test_data / "gpt2.tiktoken"))
    assert encoding.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's published ids
    assert end_of_text_id(encoding) == 50256
    assert vocabulary_size(encoding) == 50257


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "sentencepiece"}, "unknown tokenizer kind 'sentencepiece'"),
        ({"kind": "bpe", "pat_str": r"\S+"}, "lacks a valid 'ranks' entry"),
        ({"kind": "bpe", "pat_str": r"\S+", "ranks": "QQ== 0\nbad line here\n", "special_tokens": {}}, "line 2"),
        ({"kind": "bpe", "pat_str": r"\S+", "ranks": "QQ== zero\n", "special_tokens": {}}, "line 1"),
    ],
)
def test_build_encoding_names_what_is_wrong(spec, message):
    with pytest.raises(TokenizerError, match=message):
        build_encoding(spec)


def test_unreadable_tiktoken_file_is_a_tokenizer_error(tmp_path):
    with pytest.raises(TokenizerError, match="cannot read tokenizer file"):
        spec_from_tiktoken_file(tmp_path / "missing.tiktoken")


def stream(encoding, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(encoding)
    return [decoder.feed(token) for token in ids] + [decoder.flush()]


@pytest.mark.parametrize(
    "text",
    [
        # 2- and 3-byte characters, some cut inside a merged token (' \xe2' + '\x82\xac')
        "the théâtre costs 5 €, €€ €",
        "emoji 😀👍🏽 and 中文字符",  # 4-byte characters and a skin-tone modifier, CJK
        "e\u0301 combining, Ελληνικά, עברית, 🇫🇷",
    ],
)
def test_incremental_decoder_never_emits_half_a_character(encoding, text):
    ids = encoding.encode_ordinary(text)
    pieces = stream(encoding, ids)
    assert "".join(pieces) == text == encoding.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)
    # characters really were split across tokens: some tokens produced nothing until the rest arrived
    assert any(piece == "" for piece in pieces[:-1])
    assert any(not encoding.decode_single_token_bytes(t).decode("utf-8", "ignore") for t in ids)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff abc",  # a byte that never starts a character
        b"ab\xe2\x82",  # a character cut off at the end
        b"\xe2\x82a\xc3",  # cut off in the middle, then again at the end
        b"\xf0\x9f\x98\x80\x80\x80ok",  # stray continuation bytes after a whole emoji
        b"\xed\xa0\x80",  # an encoded surrogate, invalid in UTF-8
    ],
)
def test_incremental_decoder_replaces_invalid_bytes_exactly_as_decode_does(encoding, raw):
    ids = [raw[i] for i in range(len(raw))]  # byte tokens 0-255 have ids equal to their byte value
    pieces = stream(encoding, ids)
    assert "".join(pieces) == encoding.decode(ids) == raw.decode("utf-8", errors="replace")
    assert "\ufffd" in "".join(pieces)


def test_incremental_decoder_streams_text_before_the_sequence_ends(encoding):
    ids = encoding.encode_ordinary("ab €")
    decoder = IncrementalDecoder(encoding)
    assert [decoder.feed(token) for token in ids] == ["a", "b", " ", "€"]  # " \xe2" gives its space at once


def test_a_tiktoken_panic_becomes_a_tokenizer_error():
    """tiktoken's regex engine overflows its stack on a whitespace run of about a million characters and panics
    (a BaseException); encode_text turns that into a TokenizerError. The CLI never encodes so much (its prompts are
    cut to a bounded tail); this is the last line of defence."""
    encoding = build_encoding(bpe_spec({bytes([i]): i for i in range(256)}))
    with pytest.raises(TokenizerError, match="the tokenizer failed on this text"):
        encode_text(encoding, " " * 1_100_000 + "a")
