"""Tokenizers as a checkpoint describes them: a named tiktoken encoding, or byte-level BPE ranks embedded in it."""

from __future__ import annotations

import base64
import codecs
import json
from pathlib import Path

import tiktoken

from .errors import TokenizerError

END_OF_TEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer split (tiktoken's r50k_base pattern).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def encode_ranks(ranks: dict[bytes, int]) -> str:
    """The .tiktoken file format: one 'base64(token) rank' line per token, by rank."""
    return "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))


def decode_ranks(text: str) -> dict[bytes, int]:
    ranks = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise TokenizerError(f"line {line_number} of the BPE ranks is not 'base64-token rank': {line[:60]!r}") from exc
    return ranks


def bpe_spec(ranks: dict[bytes, int], pat_str: str = GPT2_PAT_STR, special_tokens: dict[str, int] | None = None) -> dict:
    """An embedded tokenizer description; by default <|endoftext|> takes the id after the last rank."""
    if special_tokens is None:
        special_tokens = {END_OF_TEXT: len(ranks)}
    return {"kind": "bpe", "pat_str": pat_str, "ranks": encode_ranks(ranks), "special_tokens": special_tokens}


def spec_from_tiktoken_file(path: str | Path) -> dict:
    """Embed a .tiktoken ranks file (such as GPT-2's) with GPT-2's split pattern."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read tokenizer file {path}: {exc}") from exc
    return bpe_spec(decode_ranks(text))


def build_encoding(spec: dict) -> tiktoken.Encoding:
    """A tiktoken.Encoding from {"kind": "tiktoken", "encoding": name} or an embedded {"kind": "bpe", ...}."""
    kind = spec.get("kind")
    if kind == "tiktoken":
        name = spec.get("encoding")
        try:
            return tiktoken.get_encoding(name)
        except Exception as exc:  # tiktoken raises ValueError for unknown names and network errors when offline
            raise TokenizerError(
                f"cannot load the tiktoken encoding {name!r} ({type(exc).__name__}); it is not in tiktoken's cache and "
                "cannot be downloaded here: embed the ranks instead (manas convert --tokenizer-file gpt2.tiktoken)"
            ) from exc
    if kind == "bpe":
        try:
            ranks = decode_ranks(spec["ranks"])
            return tiktoken.Encoding(
                name="manas-bpe", pat_str=spec["pat_str"], mergeable_ranks=ranks, special_tokens=dict(spec["special_tokens"])
            )
        except (KeyError, TypeError) as exc:
            raise TokenizerError(f"the embedded BPE tokenizer lacks a valid {exc} entry") from exc
        except ValueError as exc:
            raise TokenizerError(f"the embedded BPE tokenizer is invalid: {exc}") from exc
    raise TokenizerError(f"unknown tokenizer kind {kind!r}: expected 'tiktoken' or 'bpe'")


def parse_spec(text: str) -> dict:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"the tokenizer metadata is not valid JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise TokenizerError("the tokenizer metadata must be a JSON object")
    return spec


def end_of_text_id(encoding: tiktoken.Encoding) -> int | None:
    """The id of <|endoftext|>, or None for a vocabulary without one (nanoGPT's character-level models)."""
    return encoding.encode_single_token(END_OF_TEXT) if END_OF_TEXT in encoding.special_tokens_set else None


def _has_token(encoding: tiktoken.Encoding, piece: bytes) -> bool:
    try:
        encoding.encode_single_token(piece)
        return True
    except KeyError:
        return False


def encode_text(encoding: tiktoken.Encoding, text: str) -> list[int]:
    """Ordinary text to ids (special-token text stays plain text). A vocabulary without all 256 bytes (a
    character-level one) cannot spell every character: name those, rather than let tiktoken panic."""
    if not all(_has_token(encoding, bytes([b])) for b in range(256)):
        unknown = sorted({ch for ch in text if not _has_token(encoding, ch.encode("utf-8"))})
        if unknown:
            shown = ", ".join(repr(ch) for ch in unknown[:10])
            raise TokenizerError(f"the model's vocabulary has no token for {shown}: remove them from the prompt")
    return encoding.encode_ordinary(text)


def vocabulary_size(encoding: tiktoken.Encoding) -> int:
    """One past the largest token id, special tokens included."""
    return encoding.max_token_value + 1


class IncrementalDecoder:
    """Token ids in, text out, never half of a multi-byte UTF-8 character: the bytes of a character split across
    tokens wait for the rest. Invalid bytes become U+FFFD, exactly as tiktoken's decode of the whole sequence."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.encoding = encoding
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._utf8.decode(self.encoding.decode_single_token_bytes(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
