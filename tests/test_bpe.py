"""The byte-level BPE trainer: tiktoken ranks that round-trip any text and compress the text they learned from."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import regex
import tiktoken
import tiktoken.load

from manas_cli.formats.bpe import train_bpe
from manas_cli.formats.tokenizer import (
    END_OF_TEXT,
    GPT2_PAT_STR,
    bpe_spec,
    build_encoding,
    encode_ranks,
    end_of_text_id,
)

VOCAB_SIZE = 300


@pytest.fixture(scope="module")
def training_text(shakespeare) -> str:
    return shakespeare[:50_000]


@pytest.fixture(scope="module")
def ranks(training_text) -> dict[bytes, int]:
    return train_bpe(training_text, VOCAB_SIZE)


@pytest.fixture(scope="module")
def encoding(ranks) -> tiktoken.Encoding:
    return build_encoding(bpe_spec(ranks))


def test_ranks_are_the_256_bytes_then_merges_in_the_order_learned(ranks):
    assert len(ranks) == VOCAB_SIZE - 1  # the last id is <|endoftext|>
    assert sorted(ranks.values()) == list(range(VOCAB_SIZE - 1))
    assert all(ranks[bytes([byte])] == byte for byte in range(256))
    by_rank = sorted(ranks, key=ranks.get)
    for token in by_rank[256:]:
        # every merge joins two tokens that existed before it
        assert any(
            token[:cut] in ranks and token[cut:] in ranks and max(ranks[token[:cut]], ranks[token[cut:]]) < ranks[token]
            for cut in range(1, len(token))
        )


def test_first_merge_is_the_most_frequent_adjacent_byte_pair(training_text, ranks):
    pairs = Counter()
    for word in regex.findall(GPT2_PAT_STR, training_text):
        data = word.encode("utf-8")
        pairs.update(zip(data, data[1:]))
    (first, second), _ = pairs.most_common(1)[0]
    assert ranks[bytes([first, second])] == 256


def test_end_of_text_is_the_special_token_after_the_ranks(encoding):
    assert end_of_text_id(encoding) == VOCAB_SIZE - 1
    assert encoding.n_vocab == VOCAB_SIZE
    assert encoding.decode([VOCAB_SIZE - 1]) == END_OF_TEXT


def random_unicode(seed: int, length: int = 400) -> str:
    """Code points from the whole range (surrogates excluded: they cannot be UTF-8)."""
    generator = random.Random(seed)
    points = []
    while len(points) < length:
        point = generator.choice(
            [
                generator.randrange(0x80),
                generator.randrange(0x800),
                generator.randrange(0x10000),
                generator.randrange(0x110000),
            ]
        )
        if not 0xD800 <= point <= 0xDFFF:
            points.append(point)
    return "".join(map(chr, points))


UNICODE_TEXTS = {
    "emoji": "family 👨‍👩‍👧‍👦, flag 🏳️‍🌈, skin 👍🏽, 😀😀😀",
    "cjk": "中文字符、日本語のテキスト、한국어 텍스트",
    "combining": "a\u0300\u0301\u0302 e\u0301 \u0915\u094d\u0937 नमस्ते",
    "rtl": "مرحبا بالعالم — שלום עולם",
    "control": "\x00\x01\t\r\n\x0b\x0c\x1b[31mred\x1b[0m\x7f\u200b\u200d\ufeff",
    "whitespace": "  \n\n\t  trailing   \r\n",
    "special-looking": "text <|endoftext|> more",
    "random-0": random_unicode(0),
    "random-1": random_unicode(1),
}


@pytest.mark.parametrize("text", UNICODE_TEXTS.values(), ids=UNICODE_TEXTS)
def test_encode_decode_round_trips_arbitrary_unicode_exactly(encoding, text):
    ids = encoding.encode_ordinary(text)
    assert encoding.decode(ids, errors="strict") == text
    assert max(ids) < VOCAB_SIZE - 1


def test_trained_vocabulary_uses_fewer_tokens_than_raw_bytes(shakespeare_held_out, encoding):
    held_out = shakespeare_held_out[:20_000]  # not part of the training text
    assert len(encoding.encode_ordinary(held_out)) < 0.8 * len(held_out.encode("utf-8"))


def test_a_larger_vocabulary_compresses_further(shakespeare_held_out, training_text, encoding):
    larger = build_encoding(bpe_spec(train_bpe(training_text, 400)))
    held_out = shakespeare_held_out[:20_000]
    assert len(larger.encode_ordinary(held_out)) < len(encoding.encode_ordinary(held_out))


def test_ranks_load_with_tiktoken_directly(ranks, training_text):
    encoding = tiktoken.Encoding(
        name="trained", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks, special_tokens={END_OF_TEXT: len(ranks)}
    )
    sample = training_text[:2000]
    assert encoding.decode(encoding.encode(sample)) == sample


def test_ranks_written_as_a_tiktoken_file_load_with_tiktokens_loader(ranks, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file itself, never a cached copy
    path = tmp_path / "trained.tiktoken"
    path.write_text(encode_ranks(ranks), encoding="ascii")
    assert tiktoken.load.load_tiktoken_bpe(str(path)) == ranks


def test_training_is_deterministic(training_text, ranks):
    assert train_bpe(training_text, VOCAB_SIZE) == ranks


def test_training_stops_when_no_pair_is_left():
    ranks = train_bpe("ab ab ab", 1000)
    assert set(ranks) - {bytes([i]) for i in range(256)} == {b"ab", b" ab"}


def test_vocabulary_smaller_than_the_bytes_is_refused():
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe("some text", 256)
