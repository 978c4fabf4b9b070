"""Tokenizers as a checkpoint describes them: a named tiktoken encoding, or byte-level BPE ranks embedded in it."""

from __future__ import annotations

import base64
import codecs
import functools
import json
import os
import re
import sys
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import tiktoken

from ..errors import TokenizerError, first_line

END_OF_TEXT = "<|endoftext|>"
MAX_ID = 1 << 32  # tiktoken's ranks are u32
# A special token is a marker such as <|endoftext|>; tiktoken's regex for them fails to build near 10^6 characters,
# and takes memory out of proportion to the file with many (100,000 took 2.8 GB): their number and their total
# length are bounded too (FORMAT.md). Real tokenizers have from one (GPT-2) to a few hundred.
MAX_SPECIAL_TOKEN_CHARS = 1000
MAX_SPECIAL_TOKENS = 4096
MAX_SPECIAL_TOKENS_TOTAL_CHARS = 65536
# GPT-2's pre-tokenizer split (tiktoken's r50k_base pattern).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-2's split after Hugging Face's Digits(individual_digits) pre-tokenizer (SmolLM2's): every digit a piece of its
# own, so no space joins a digit, and a run of spaces before a digit ends there whole (as it ends a piece).
DIGITS_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
# Qwen2's split (its tokenizer.json's Split regex), which llama.cpp runs as its "qwen2" pre-tokenizer.
QWEN2_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# Llama 3's split (its tokenizer.json's Split regex), which llama.cpp runs as its "llama-bpe" pre-tokenizer.
LLAMA3_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
NORMALIZATIONS = ("NFC",)  # what a tokenizer may ask of the text before it is split (Qwen2's)
# Tokenizer files are a few MB (GPT-2's vocab.json 1 MB, a 150,000-token tokenizer.json 11 MB): a larger one is
# refused before it is parsed, as its tokens would take memory out of proportion to it.
MAX_TOKENIZER_FILE_BYTES = 64 * 2**20


class Encoding(tiktoken.Encoding):
    """tiktoken's encoding of an embedded BPE, with what its spec adds: the Unicode normalization the text gets
    before it is split (None, or NFC), the special token that ends a text, the one that begins every prompt (None:
    none, as GPT-2, SmolLM2 and Qwen2 have), and where its skipped bytes' ids begin (None: it has every byte).

    A real byte-level BPE may lack a token for some bytes (SmolLM2's has none for 21 of them: control characters
    and bytes no UTF-8 text holds); Hugging Face's tokenizer drops such a byte. tiktoken cannot run without every
    byte, so each gets a rank of its own past the vocabulary (never a merge's part: no merged token holds it), and
    encode_text drops those ids: the ids are Hugging Face's, whatever the text."""

    def __init__(
        self, *, normalization: str | None, end_of_text: str, bos: str | None, skipped_from: int | None, **values
    ) -> None:
        super().__init__(**values)
        self.normalization, self.end_of_text, self.bos = normalization, end_of_text, bos
        self.skipped_from = skipped_from


def encode_ranks(ranks: dict[bytes, int]) -> str:
    """The .tiktoken file format: one 'base64(token) rank' line per token, by rank."""
    return "".join(
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )


def decode_ranks(text: str) -> dict[bytes, int]:
    """A .tiktoken file's ranks, each token and each rank given once, every rank in [0, 2^32)."""
    if not isinstance(text, str):
        raise TokenizerError(f"the BPE ranks must be the text of a .tiktoken file, got {type(text).__name__}")
    ranks: dict[bytes, int] = {}
    lines: dict[int, int] = {}  # rank -> the line that gave it
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            encoded, rank_text = line.split()
            token, rank = base64.b64decode(encoded, validate=True), int(rank_text)
        except ValueError as exc:
            raise TokenizerError(
                f"line {line_number} of the BPE ranks is not 'base64-token rank': {line[:60]!r}"
            ) from exc
        if not 0 <= rank < MAX_ID:
            raise TokenizerError(f"line {line_number} of the BPE ranks: rank {rank} is outside [0, 2^32)")
        if not token:
            raise TokenizerError(f"line {line_number} of the BPE ranks: the token is empty")
        if token in ranks:
            raise TokenizerError(
                f"line {line_number} of the BPE ranks: token {token!r} already has rank {ranks[token]}"
            )
        if rank in lines:
            raise TokenizerError(
                f"line {line_number} of the BPE ranks: rank {rank} is already given on line {lines[rank]}"
            )
        ranks[token], lines[rank] = rank, line_number
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable alias of every byte, the alphabet of vocab.json and merges.txt: printable Latin-1
    characters stand for themselves, the rest (controls, space) are shifted past 255 so no token shows a space."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    aliases = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in aliases)
    for offset, byte in enumerate(shifted):
        aliases[byte] = chr(256 + offset)
    return dict(sorted(aliases.items()))


def read_tokenizer_text(path: Path, src: Path) -> str:
    """A tokenizer file of src's (or src itself) as text, refused past MAX_TOKENIZER_FILE_BYTES before it is read."""
    try:
        if path.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
            raise TokenizerError(
                f"{path} is over {MAX_TOKENIZER_FILE_BYTES // 2**20} MiB: not a tokenizer file manas reads"
            )
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read the tokenizer files of {src}: {first_line(exc)}") from None


def spec_from_hf_files(
    vocab_json: str, merges_txt: str, source: str | Path, added: frozenset[str] = frozenset()
) -> dict:
    """GPT-2's tokenizer files (vocab.json: token in GPT-2's byte alphabet → id; merges.txt: the merges in the
    order they apply) as an embedded BPE with GPT-2's split (see spec_from_vocab_and_merges). A special token is
    one that no merge builds, spelled as a marker (<|endoftext|>, <s>, <pad>) or among `added`, the added tokens
    the folder lists beside them."""
    try:
        vocab = json.loads(vocab_json)
    except (ValueError, RecursionError) as exc:
        raise TokenizerError(f"{source}: vocab.json is not valid JSON: {first_line(exc)}") from None
    merges = [
        (number, line)
        for number, line in enumerate(merges_txt.splitlines(), start=1)
        if line.strip() and not line.startswith("#version")
    ]
    return spec_from_vocab_and_merges(vocab, merges, added, source, "vocab.json", "line {} of merges.txt", markers=True)


def spec_from_tokenizer_json(tokenizer_json: str, source: str | Path) -> dict:
    """A Hugging Face tokenizer.json (what transformers 5 saves in place of vocab.json and merges.txt) holding a
    byte-level BPE: its `model.vocab`, `model.merges` (as "a b" strings or [a, b] pairs), `added_tokens`, the split
    its pre-tokenizer makes (split_pattern) and its normalizer; any other kind is refused by name."""
    try:
        value = json.loads(tokenizer_json)
    except (ValueError, RecursionError) as exc:
        raise TokenizerError(f"{source}: tokenizer.json is not valid JSON: {first_line(exc)}") from None
    model = value.get("model") if isinstance(value, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise TokenizerError(
            f"{source}: tokenizer.json's model is {kind!r}, not a BPE: manas reads byte-level BPEs only"
        )
    if model.get("byte_fallback"):
        from .sentencepiece import spec_from_tokenizer_json as sentencepiece_spec

        return sentencepiece_spec(value, source)
    pat_str = split_pattern(value.get("pre_tokenizer"), source)
    normalization = _normalization(value.get("normalizer"), source)
    merges = [
        (number, " ".join(merge) if isinstance(merge, list) else merge)
        for number, merge in enumerate(model.get("merges") or [], start=1)
    ]
    if not all(isinstance(merge, str) for _, merge in merges):
        raise TokenizerError(f"{source}: tokenizer.json's model.merges must be 'a b' strings or [a, b] pairs")
    added = value.get("added_tokens") or []
    if not isinstance(added, list) or not all(
        isinstance(t, dict) and isinstance(t.get("content"), str) and type(t.get("id")) is int for t in added
    ):
        raise TokenizerError(
            f"{source}: tokenizer.json's added_tokens must be a list of objects with a 'content' and an integer 'id'"
        )
    specials, vocab_name = frozenset(t["content"] for t in added), "tokenizer.json's model.vocab"
    if pat_str == LLAMA3_PAT_STR:  # Llama 3's vocabulary is tiktoken's: its ids are the ranks
        spec = tiktoken_vocabulary(model.get("vocab"), specials, source, vocab_name, pat_str)
    else:
        spec = spec_from_vocab_and_merges(
            model.get("vocab"), merges, specials, source, vocab_name, "merge {} of tokenizer.json", pat_str=pat_str
        )
    # Added tokens outside model.vocab (<|endoftext|> in Qwen2's and SmolLM2's) are special tokens of their own ids.
    vocab = model.get("vocab")
    spec["special_tokens"] |= {t["content"]: t["id"] for t in added if t["content"] not in vocab}
    return checked_spec(spec | ({"normalization": normalization} if normalization else {}), source)


SENTENCEPIECE_STYLE = (
    "tokenizer.json is a SentencePiece-style BPE without byte fallback: manas runs SentencePiece BPEs with byte "
    "fallback (Llama 2's, TinyLlama's, Mistral's) and byte-level BPEs (SmolLM2's, Qwen2's, Llama 3's, GPT-2's)"
)


def split_pattern(pre: object, source: str | Path) -> str:
    """The tiktoken pattern that splits text as a tokenizer.json's pre-tokenizer does, for the byte-level BPEs manas
    reads: GPT-2's ByteLevel split; individual digits, then GPT-2's split (SmolLM2); a Split by a regex, each match
    a piece, then a ByteLevel that only maps bytes (Llama 3, Qwen2). Anything else is refused by name."""
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    steps = [step if isinstance(step, dict) else {} for step in (steps if isinstance(steps, list) else [])]
    kinds = [step.get("type") for step in steps]
    if "Metaspace" in kinds:
        raise TokenizerError(f"{source}: {SENTENCEPIECE_STYLE} (its pre-tokenizer is 'Metaspace')")
    if any(step.get("add_prefix_space") for step in steps):
        raise TokenizerError(f"{source}: tokenizer.json's ByteLevel adds a prefix space, which tiktoken cannot")
    splits = [step.get("use_regex", True) for step in steps if step.get("type") == "ByteLevel"]
    if kinds == ["ByteLevel"] and splits == [True]:
        return GPT2_PAT_STR
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") is True and splits == [True]:
        return DIGITS_PAT_STR
    if kinds == ["Split", "ByteLevel"] and splits == [False]:
        split, pattern = steps[0], (steps[0].get("pattern") or {}).get("Regex")
        if split.get("behavior") == "Isolated" and not split.get("invert") and isinstance(pattern, str) and pattern:
            return pattern
    shown = " + ".join(str(kind) for kind in kinds) or repr(pre)
    raise TokenizerError(
        f"{source}: tokenizer.json's pre-tokenizer ({shown}) is not one manas reads: GPT-2's ByteLevel, Digits + "
        "ByteLevel (SmolLM2), or Split by a regex + ByteLevel (Llama 3, Qwen2)"
    )


def _normalization(normalizer: object, source: str | Path) -> str | None:
    """None for no normalizer, "NFC" for Unicode's (Qwen2's); anything else is refused by name."""
    kind = normalizer.get("type") if isinstance(normalizer, dict) else normalizer
    if kind is None or (kind == "Sequence" and not normalizer.get("normalizers")):
        return None
    if kind in NORMALIZATIONS:
        return kind
    raise TokenizerError(f"{source}: tokenizer.json's normalizer {kind!r} is not one manas runs (none, or NFC)")


def tiktoken_vocabulary(
    vocab: object, specials: frozenset[str], source: str | Path, vocab_name: str, pat_str: str
) -> dict:
    """Llama 3's tokenizer is a tiktoken one (Meta's tokenizer.model is a ranks file): its merges, written out for
    Hugging Face and llama.cpp afterwards, are tiktoken's ranks rather than the order a BPE builds them in, so they
    cannot be checked as one (spec_from_vocab_and_merges); its ids are tiktoken's ranks, which give Hugging Face's
    and llama.cpp's ids (tested on llama.cpp's own fixtures for it, and on `tokenizers` running the same file)."""
    if not isinstance(vocab, dict) or not all(type(i) is int for i in vocab.values()):
        raise TokenizerError(f"{source}: {vocab_name} must map each token to an integer id")
    byte_of = {alias: byte for byte, alias in bytes_to_unicode().items()}
    ranks, special = {}, {}
    for token, token_id in vocab.items():
        if token in specials:
            special[token] = token_id
        elif all(ch in byte_of for ch in token):
            ranks[bytes(byte_of[ch] for ch in token)] = token_id
        else:
            raise TokenizerError(
                f"{source}: {vocab_name} token {token[:40]!r} (id {token_id}) is not spelled in GPT-2's byte alphabet"
            )
    return byte_level_spec(ranks, pat_str, special)


def spec_from_vocab_and_merges(
    vocab: object,
    merges: list[tuple[int, str]],
    specials: frozenset[str],
    source: str | Path,
    vocab_name: str,
    merge_name: str,
    markers: bool = False,
    pat_str: str = GPT2_PAT_STR,
) -> dict:
    """A byte-level BPE's vocabulary (token in GPT-2's byte alphabet → id) and its merges, numbered, in the order
    they apply. tiktoken merges whichever adjacent pair's concatenation has the lowest rank, Hugging Face only the
    listed pairs, by their order; the two tokenize alike when each merge's parts are built by earlier merges (or
    are bytes), each merge builds a token whose id is larger than the last merge's, and tiktoken, splitting a
    merged token with the ranks below its own, arrives at the listed pair. Every other token longer than a byte is
    a special token: one of `specials`, or with markers any spelled as a <marker>."""
    if not isinstance(vocab, dict) or not all(type(i) is int for i in vocab.values()):
        raise TokenizerError(f"{source}: {vocab_name} must map each token to an integer id")
    byte_of = {alias: byte for byte, alias in bytes_to_unicode().items()}
    built, pairs, last = set(), {}, -1
    for number, line in merges:
        where = merge_name.format(number)
        parts = line.split(" ")
        if len(parts) != 2 or "".join(parts) not in vocab:
            raise TokenizerError(
                f"{source}: {where} is not a merge of two tokens into one of {vocab_name}: {line[:60]!r}"
            )
        if unbuilt := [part for part in parts if len(part) > 1 and part not in built]:
            raise TokenizerError(
                f"{source}: {where} merges {unbuilt[0]!r}, which no earlier merge builds, so "
                "Hugging Face never forms it: the merges are not a BPE's"
            )
        merged = "".join(parts)
        if vocab[merged] <= last:
            raise TokenizerError(
                f"{source}: {where} builds {merged!r} (id {vocab[merged]}), not above the "
                "previous merge's id, so tiktoken would merge in another order than Hugging Face"
            )
        built.add(merged)
        pairs[merged] = (where, parts)
        last = vocab[merged]
    ranks, special = {}, {}
    for token, token_id in vocab.items():
        if len(token) > 1 and token not in built:
            if token not in specials and not (markers and _is_marker(token)):
                raise TokenizerError(
                    f"{source}: {vocab_name} token {token[:40]!r} (id {token_id}) is longer than a "
                    "byte, but no merge builds it and it is not a special token: the vocabulary "
                    "and the merges do not belong together"
                )
            special[token] = token_id
        elif all(ch in byte_of for ch in token):
            ranks[bytes(byte_of[ch] for ch in token)] = token_id
        else:
            raise TokenizerError(f"{source}: {vocab_name} token {token!r} is not spelled in GPT-2's byte alphabet")
    _check_merges_as_ranks(ranks, pairs, byte_of, source)
    return checked_spec(byte_level_spec(ranks, pat_str, special), source)


def byte_level_spec(ranks: dict[bytes, int], pat_str: str, special: dict[str, int]) -> dict:
    """The embedded spec of a real byte-level BPE's ranks, which may lack some bytes: Hugging Face (and llama.cpp)
    drop a byte without a token, so the spec says to skip them (FORMAT.md, unknown_bytes)."""
    spec = bpe_spec(ranks, pat_str, special_tokens=special)
    if any(bytes([byte]) not in ranks for byte in range(256)):
        spec["unknown_bytes"] = "skip"
    return spec


def _is_marker(token: str) -> bool:
    return len(token) > 2 and token.startswith("<") and token.endswith(">")


def _check_merges_as_ranks(
    ranks: dict[bytes, int], pairs: dict[str, tuple[str, list[str]]], byte_of: dict[str, int], source: str | Path
) -> None:
    """Refuse merges that tiktoken's ranks would apply otherwise: for `b c`, `a b`, `ab c`, tiktoken joins `a` and
    `bc` into `abc` (both are ranks), where Hugging Face, having merged `b c`, has no merge for `a bc`."""

    def spelled(token: str) -> bytes:
        return bytes(byte_of[ch] for ch in token)

    for merged, (where, parts) in pairs.items():
        found = merge_parts(ranks, spelled(merged), ranks[spelled(merged)])  # the parts its last merge joins
        if found != [spelled(part) for part in parts]:
            shown = " + ".join(repr(part.decode("utf-8", "replace")) for part in found)
            raise TokenizerError(
                f"{source}: {where} builds {merged!r} from {parts[0]!r} + {parts[1]!r}, but by rank "
                f"tiktoken builds it from {shown}, so the two would tokenize differently"
            )


def merge_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-pair merge the token's bytes as tiktoken does (lowest rank first), using ranks below max_rank only."""
    parts = [bytes([byte]) for byte in token]
    while True:
        best: tuple[int, int] | None = None  # (rank, position)
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def bpe_spec(
    ranks: dict[bytes, int], pat_str: str = GPT2_PAT_STR, special_tokens: dict[str, int] | None = None
) -> dict:
    """An embedded tokenizer description; by default <|endoftext|> takes the id after the last rank."""
    if special_tokens is None:
        special_tokens = {END_OF_TEXT: len(ranks)}
    return {"kind": "bpe", "pat_str": pat_str, "ranks": encode_ranks(ranks), "special_tokens": special_tokens}


def spec_from_tiktoken_file(path: str | Path) -> dict:
    """Embed a .tiktoken ranks file (such as GPT-2's) with GPT-2's split pattern, validated as build_encoding does."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read tokenizer file {path}: {exc}") from exc
    try:
        ranks = decode_ranks(text)
    except TokenizerError as exc:
        raise TokenizerError(f"{path}: {exc}") from None
    return checked_spec(bpe_spec(ranks), path)


def checked_spec(spec: dict, source: str | Path) -> dict:
    """The spec, once build_encoding accepts it; its refusal names the file the tokenizer came from."""
    try:
        build_encoding(spec)
    except TokenizerError as exc:
        raise TokenizerError(f"{source}: {exc}") from None
    return spec


SHIPPED_GPT2 = Path(__file__).resolve().parents[1] / "data" / "gpt2.tiktoken"  # data/SOURCES.md


@functools.cache
def shipped_gpt2() -> tiktoken.Encoding:
    """tiktoken's named gpt2 encoding (r50k_base's ranks and pattern, <|endoftext|> 50256) from the ranks the
    package ships: offline, with no download and no cache."""
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=load_tiktoken_bpe(str(SHIPPED_GPT2)),
        special_tokens={ENDOFTEXT: 50256},
        explicit_n_vocab=50257,
    )


def build_encoding(spec: dict) -> tiktoken.Encoding:
    """A tiktoken.Encoding from {"kind": "tiktoken", "encoding": name} or an embedded {"kind": "bpe", ...}, the
    embedded form fully validated (see check_bpe): every id from 0 to the largest names exactly one token."""
    kind = spec.get("kind")
    if kind == "tiktoken" and spec.get("encoding") == "gpt2":
        return shipped_gpt2()
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
        for key in ("pat_str", "ranks", "special_tokens"):
            if key not in spec:
                raise TokenizerError(f"the embedded BPE tokenizer lacks a valid {key!r} entry")
        ranks = decode_ranks(spec["ranks"])
        check_bpe(spec["pat_str"], ranks, spec["special_tokens"])
        normalization = spec.get("normalization")
        if normalization is not None and normalization not in NORMALIZATIONS:
            raise TokenizerError(
                f"the embedded BPE tokenizer's normalization must be NFC or absent, got {normalization!r}"
            )
        end_of_text, bos = _special_entry(spec, "end_of_text") or END_OF_TEXT, _special_entry(spec, "bos")
        skipped_from = _skip_unknown_bytes(spec, ranks)
        try:
            with tiktoken_errors():
                return Encoding(
                    name="manas-bpe",
                    pat_str=spec["pat_str"],
                    mergeable_ranks=ranks,
                    special_tokens=spec["special_tokens"],
                    normalization=normalization,
                    end_of_text=end_of_text,
                    bos=bos,
                    skipped_from=skipped_from,
                )
        except ValueError as exc:  # the pattern does not compile
            raise TokenizerError(f"the embedded BPE tokenizer's pat_str is invalid: {first_line(exc)}") from None
    if kind == "spm":
        from .sentencepiece import build_spm

        return build_spm(spec)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}: expected 'tiktoken', 'bpe' or 'spm'")


def _skip_unknown_bytes(spec: dict, ranks: dict[bytes, int]) -> int | None:
    """For a spec whose unknown_bytes is "skip": each byte without a token given a rank past every id (in ranks,
    changed in place), and the first of those ranks; None for a spec without the key."""
    skip = spec.get("unknown_bytes")
    if skip is None:
        return None
    if skip != "skip":
        raise TokenizerError(f"the embedded BPE tokenizer's unknown_bytes must be 'skip' or absent, got {skip!r}")
    skipped_from = max([*ranks.values(), *spec["special_tokens"].values()], default=-1) + 1
    for offset, byte in enumerate(byte for byte in range(256) if bytes([byte]) not in ranks):
        ranks[bytes([byte])] = skipped_from + offset
    return skipped_from


def ordinary_ranks(encoding: tiktoken.Encoding) -> dict[bytes, int]:
    """The encoding's ordinary tokens by rank, without the ranks of the bytes it skips."""
    skipped_from = getattr(encoding, "skipped_from", None)
    ranks = encoding._mergeable_ranks  # tiktoken keeps them only in this attribute
    return ranks if skipped_from is None else {token: rank for token, rank in ranks.items() if rank < skipped_from}


def _special_entry(spec: dict, key: str) -> str | None:
    """An optional key of an embedded spec naming one of its special tokens (end_of_text, bos), or None."""
    value = spec.get(key)
    if value is not None and not (isinstance(value, str) and value in spec["special_tokens"]):
        raise TokenizerError(f"the embedded BPE tokenizer's {key} {value!r} is not one of its special tokens")
    return value


def bos_id(encoding: tiktoken.Encoding) -> int | None:
    """The id of the token every prompt begins with (Llama 3's <|begin_of_text|>), or None."""
    bos = getattr(encoding, "bos", None)
    return None if bos is None else encoding.encode_single_token(bos)


def check_bpe(pat_str: object, ranks: dict[bytes, int], special_tokens: object) -> None:
    """What tiktoken does not check itself: a pattern that cannot backtrack catastrophically (pattern_is_safe),
    special tokens with integer ids in [0, 2^32) that no other token has, and ids with no holes."""
    if not isinstance(pat_str, str) or not pat_str:
        raise TokenizerError(
            f"the embedded BPE tokenizer's pat_str must be a non-empty regular expression, got {pat_str!r}"
        )
    if not pattern_is_safe(pat_str):
        raise TokenizerError(
            f"the embedded BPE tokenizer's pat_str {pat_str[:60]!r} uses a backreference or a conditional, whose "
            "matching time grows with the square of the text or worse; manas refuses them (see FORMAT.md)"
        )
    if not isinstance(special_tokens, dict):
        raise TokenizerError(f"the embedded BPE tokenizer's special_tokens must be an object, got {special_tokens!r}")
    if len(special_tokens) > MAX_SPECIAL_TOKENS:
        raise TokenizerError(
            f"the tokenizer has {len(special_tokens):,} special tokens; at most {MAX_SPECIAL_TOKENS:,} are allowed"
        )
    if (total := sum(map(len, special_tokens))) > MAX_SPECIAL_TOKENS_TOTAL_CHARS:
        raise TokenizerError(
            f"the tokenizer's special tokens are {total:,} characters long in all; at most "
            f"{MAX_SPECIAL_TOKENS_TOTAL_CHARS:,} are allowed"
        )
    owners = {rank: token for token, rank in ranks.items()}
    for text, token_id in special_tokens.items():
        if len(text) > MAX_SPECIAL_TOKEN_CHARS:  # tiktoken matches them with one regex, which has a size limit
            raise TokenizerError(
                f"special token {text[:40]!r}… is {len(text):,} characters long; at most {MAX_SPECIAL_TOKEN_CHARS:,} "
                "are allowed"
            )
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < MAX_ID:
            raise TokenizerError(f"special token {text!r} has id {token_id!r}, not an integer in [0, 2^32)")
        if token_id in owners:
            raise TokenizerError(
                f"special token {text!r} has id {token_id}, which is already the token {owners[token_id]!r}"
            )
        owners[token_id] = text
    if not owners:
        raise TokenizerError("the embedded BPE tokenizer has no tokens")
    if holes := max(owners) + 1 - len(owners):
        first = next(i for i in range(len(owners) + 1) if i not in owners)  # among the first len + 1 ids, one is free
        raise TokenizerError(f"no token has id {first} ({holes} id(s) below the largest, {max(owners)}, have none)")


def pattern_is_safe(pat_str: str) -> bool:
    """A pattern without backreferences (\\1, \\k<name>, (?P=name)) or conditionals ((?(1)...)).

    Atomic groups and possessive quantifiers (which tiktoken's own r50k, p50k, cl100k and o200k patterns use) only
    cut backtracking short, and fancy-regex hands the plain parts of a lookaround to the linear-time regex crate, so
    the bounded prompt text (encode_prompt) keeps them fast. A backreference is matched by backtracking over every
    earlier split of the text: `(a+)\\1b|.` took 6 s on 20,000 a's where `(?=a+b)a|.` took 0.3 s, and the
    300,000 characters a prompt may have would take hours."""
    return not _BACKTRACKING.search(_CLASSES.sub("", _ESCAPES.sub(_plain_escape, pat_str)))


# Escapes: a backreference (\1, \k<name>, \g) becomes _MARK; any other escaped character is a plain literal.
_ESCAPES = re.compile(r"\\([pP]\{[^}]*\}|.)", re.DOTALL)
_CLASSES = re.compile(r"\[\^?\]?[^\]]*\]")  # inside a character class every character is literal
_MARK = "\ue000"  # a private-use character: no pattern needs it
_BACKTRACKING = re.compile(_MARK + r"|\(\?\(|\(\?P=")  # a backreference, a conditional, a named backreference


def _plain_escape(match: re.Match) -> str:
    return _MARK if match.group(1) in tuple("123456789kg") else "e"


@contextmanager
def tiktoken_errors() -> Iterator[None]:
    """The last line of defence around tiktoken: its Rust code reports some failures (a regex stack overflow) by
    panicking, and pyo3's PanicException is a BaseException that no `except Exception` catches. pyo3 does not
    export the type, so it is recognised by name."""
    try:
        with _panic_text_silenced():
            yield
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        if "pointer is null" in str(exc) or "alloc" in str(exc):  # pyo3 could not allocate the result
            raise TokenizerError("out of memory while tokenizing the text: pass a shorter text") from None
        raise TokenizerError(f"the tokenizer failed on this text ({first_line(exc)})") from None


@contextmanager
def _panic_text_silenced() -> Iterator[None]:
    """Rust's panic hook writes its message (and with RUST_BACKTRACE, a backtrace) straight to descriptor 2, before
    the exception reaches us: point that descriptor at /dev/null for the call."""
    if sys.stderr is not None:
        sys.stderr.flush()  # what Python has buffered for stderr is not the panic's
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def parse_spec(text: str) -> dict:
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise TokenizerError(f"the tokenizer metadata is not valid JSON: {first_line(exc)}") from None
    if not isinstance(spec, dict):
        raise TokenizerError("the tokenizer metadata must be a JSON object")
    return spec


def end_of_text_id(encoding: tiktoken.Encoding) -> int | None:
    """The id of the token that ends a text (<|endoftext|>, or the one an embedded spec names), or None for a
    vocabulary without one (nanoGPT's character-level models)."""
    token = getattr(encoding, "end_of_text", END_OF_TEXT)
    return encoding.encode_single_token(token) if token in encoding.special_tokens_set else None


def _has_token(encoding: tiktoken.Encoding, piece: bytes) -> bool:
    try:
        encoding.encode_single_token(piece)
        return True
    except KeyError:
        return False


def encode_text(encoding: tiktoken.Encoding, text: str, special: bool = False) -> list[int]:
    """Ordinary text to ids: special-token text stays plain text, unless `special` (a chat template's rendering,
    whose <|im_start|> are the tokens themselves). A vocabulary without all 256 bytes (a character-level one)
    cannot spell every character: name those, rather than let tiktoken panic."""
    if not all(_has_token(encoding, bytes([b])) for b in range(256)):
        unknown = sorted({ch for ch in text if not _has_token(encoding, ch.encode("utf-8"))})
        if unknown:
            shown = ", ".join(repr(ch) for ch in unknown[:10])
            raise TokenizerError(f"the model's vocabulary has no token for {shown}: remove them from the prompt")
    if normalization := getattr(encoding, "normalization", None):
        text = unicodedata.normalize(normalization, text)
    with tiktoken_errors():
        ids = encoding.encode(text, allowed_special="all") if special else encoding.encode_ordinary(text)
    skipped_from = getattr(encoding, "skipped_from", None)
    return ids if skipped_from is None else [token for token in ids if token < skipped_from]


# The most characters one encode call of a training text gets: far below the whitespace run (about 10^6 characters)
# that overflows tiktoken's regex stack.
ENCODE_CHUNK_CHARS = 100_000


def encode_long_text(encoding: tiktoken.Encoding, text: str) -> list[int]:
    """encode_text over a text of any length, in pieces (text_pieces) that give the ids of the whole text."""
    return [token for piece in text_pieces(text, ENCODE_CHUNK_CHARS) for token in encode_text(encoding, piece)]


def text_pieces(text: str, size: int) -> Iterator[str]:
    """text in pieces of at most `size` characters, each cut after a newline that a non-space character follows: no
    piece of GPT-2's split (nor cl100k's, o200k's, or a character-level one) crosses such a place, so the pieces
    encode to the ids of the whole. A stretch with no such place (a whitespace run of `size` characters) is cut
    where the piece is full; only there could the ids differ from the whole's, which tiktoken cannot encode."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            end = _last_boundary(text, start, end) or end
        yield text[start:end]
        start = end


def _last_boundary(text: str, start: int, end: int) -> int | None:
    """The last index in (start, end] that follows a newline and holds a non-space character, if any."""
    newline = text.rfind("\n", start, end - 1)
    while newline >= start:
        if not text[newline + 1].isspace():
            return newline + 1
        newline = text.rfind("\n", start, newline)
    return None


def longest_token_bytes(encoding: tiktoken.Encoding) -> int:
    """The most bytes one ordinary token stands for: n tokens never cover more than n times this many characters."""
    return max(map(len, encoding.token_byte_values()), default=1)


def vocabulary_size(encoding: tiktoken.Encoding) -> int:
    """One past the largest token id, special tokens included (the skipped bytes' are not tokens)."""
    skipped_from = getattr(encoding, "skipped_from", None)
    return encoding.max_token_value + 1 if skipped_from is None else skipped_from


def decodable(encoding: tiktoken.Encoding) -> list[bool]:
    """For each id below vocabulary_size, whether a token has it. An embedded tokenizer has no holes (check_bpe),
    but tiktoken's own encodings may (cl100k_base's special tokens are not contiguous)."""
    ids = [False] * vocabulary_size(encoding)
    for token_id in (*ordinary_ranks(encoding).values(), *encoding._special_tokens.values()):  # no public accessor
        ids[token_id] = True
    return ids


def vocabulary_difference(a: tiktoken.Encoding, b: tiktoken.Encoding) -> str | None:
    """Where two vocabularies differ (a draft model must draw the ids the model reads): None when every id names
    the same bytes in both."""
    size_a, size_b = vocabulary_size(a), vocabulary_size(b)
    if size_a != size_b:
        return f"{size_a:,} token ids against {size_b:,}"
    for token_id in range(size_a):
        if (piece := _token_bytes(a, token_id)) != (other := _token_bytes(b, token_id)):
            return f"id {token_id} is {piece!r} against {other!r}"
    return None


def _token_bytes(encoding: tiktoken.Encoding, token_id: int) -> bytes | None:
    try:
        return encoding.decode_single_token_bytes(token_id)
    except KeyError:  # a hole in the ids
        return None


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
