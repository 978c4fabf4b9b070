"""A GGUF file's tokenizer (its tokenizer.ggml.* fields), as an embedded BPE that encodes to the ids llama.cpp
gives: a byte-level BPE (tokenizer.ggml.model "gpt2") with its tokens, token types and merges, split as its
pre-tokenizer name says. Reading one needs the `gguf` extra (llama.cpp's own reader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import MissingDependencyError, TokenizerError, first_line
from .gguf_metadata import read_metadata
from .tokenizer import (
    DIGITS_PAT_STR,
    GPT2_PAT_STR,
    LLAMA3_PAT_STR,
    QWEN2_PAT_STR,
    checked_spec,
    spec_from_vocab_and_merges,
    tiktoken_vocabulary,
)

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) and the splits they make: SmolLM2's, StarCoder2's and
# Refact's are one (each digit alone, then GPT-2's split).
PRE_TOKENIZERS = {
    "gpt-2": GPT2_PAT_STR,
    "phi-2": GPT2_PAT_STR,
    "default": GPT2_PAT_STR,
    "llama-bpe": LLAMA3_PAT_STR,
    "qwen2": QWEN2_PAT_STR,
    "smollm": DIGITS_PAT_STR,
    "starcoder": DIGITS_PAT_STR,
    "refact": DIGITS_PAT_STR,
}
# llama.cpp's token types that are special tokens, never merged: control (<|im_end|>), user-defined ([PAD…] in
# Qwen2's), unused (the placeholders of a vocabulary padded past its tokenizer)
SPECIAL_TYPES = (3, 4, 5)


def spec_from_gguf(path: Path) -> dict:
    """The embedded tokenizer of a GGUF file; one TokenizerError naming what it cannot read."""
    return spec_from_fields(read_metadata(path), path)


def spec_from_fields(fields: dict, path: Path) -> dict:
    """The embedded tokenizer of a GGUF file, from its metadata (gguf_metadata.read_metadata's values)."""
    model = string_field(fields, "tokenizer.ggml.model", path)
    if model == "llama":
        return _sentencepiece(fields, path)
    if model != "gpt2":
        raise TokenizerError(f"{path}: tokenizer.ggml.model {model!r} is not one manas reads (gpt2, llama)")
    pre = string_field(fields, "tokenizer.ggml.pre", path) if "tokenizer.ggml.pre" in fields else "default"
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"{path}: its pre-tokenizer {pre!r} is not one manas runs ({', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tokens = _strings(fields, "tokenizer.ggml.tokens", path)
    types = _list(fields, "tokenizer.ggml.token_type", path) if "tokenizer.ggml.token_type" in fields else []
    merges = _strings(fields, "tokenizer.ggml.merges", path) if "tokenizer.ggml.merges" in fields else []
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{path}: tokenizer.ggml.tokens names a token twice")
    specials = frozenset(token for token, kind in zip(tokens, types) if kind in SPECIAL_TYPES)
    if pre == "llama-bpe":  # Llama 3's vocabulary is tiktoken's: its ids are the ranks (see tiktoken_vocabulary)
        spec = tiktoken_vocabulary(vocab, specials, path, "tokenizer.ggml.tokens", PRE_TOKENIZERS[pre])
    else:
        spec = spec_from_vocab_and_merges(
            vocab,
            list(enumerate(merges, start=1)),
            specials,
            path,
            "tokenizer.ggml.tokens",
            "merge {} of tokenizer.ggml.merges",
            pat_str=PRE_TOKENIZERS[pre],
        )
    return checked_spec(spec | _ends(fields, tokens, spec["special_tokens"]), path)


def _sentencepiece(fields: dict, path: Path) -> dict:
    """A SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2's, TinyLlama's, Mistral's): its pieces,
    scores and types, and whether a space goes before the text (formats/sentencepiece.py)."""
    tokens = _strings(fields, "tokenizer.ggml.tokens", path)
    scores = _list(fields, "tokenizer.ggml.scores", path)
    types = _list(fields, "tokenizer.ggml.token_type", path)
    prefix = fields.get("tokenizer.ggml.add_space_prefix")
    spec = {
        "kind": "spm",
        "pieces": tokens,
        "scores": [float(score) for score in scores],
        "types": [int(kind) for kind in types],
        "add_space_prefix": prefix is not False,
    }
    special = {token: i for i, (token, kind) in enumerate(zip(tokens, spec["types"])) if kind in SPM_SPECIAL_TYPES}
    ends = _ends(fields, tokens, special)
    if "end_of_text" not in ends:
        raise TokenizerError(f"{path}: its SentencePiece vocabulary names no end of text (tokenizer.ggml.eos_token_id)")
    return checked_spec(spec | ends, path)


SPM_SPECIAL_TYPES = (3, 5)  # control and unused: never spelled by text (sentencepiece's user-defined pieces are)


def _ends(fields: dict, tokens: list[str], special: dict[str, int]) -> dict:
    """end_of_text and bos as the file names them (by id), where they are special tokens; bos only where llama.cpp
    adds it (tokenizer.ggml.add_bos_token)."""
    ends = {}
    eos = _integer(fields, "tokenizer.ggml.eos_token_id")
    if eos is not None and 0 <= eos < len(tokens) and tokens[eos] in special:
        ends["end_of_text"] = tokens[eos]
    bos = _integer(fields, "tokenizer.ggml.bos_token_id")
    adds = fields.get("tokenizer.ggml.add_bos_token")
    if adds is True and bos is not None and 0 <= bos < len(tokens):
        if tokens[bos] in special:
            ends["bos"] = tokens[bos]
    return ends


def import_gguf(purpose: str) -> Any:
    """The gguf package (llama.cpp's own reader and writer), or one MissingDependencyError saying what `purpose`
    needs it for."""
    try:
        import gguf
    except ImportError:
        raise MissingDependencyError(
            f'{purpose} needs the gguf package: pip install "manas-cli[gguf]" (from a clone: pip install -e ".[gguf]")'
        ) from None
    except Exception as exc:  # installed but broken (a half-finished upgrade, a numpy it does not support)
        raise MissingDependencyError(
            f"the gguf package fails to import ({type(exc).__name__}: {first_line(exc)}): reinstall it with "
            'pip install --force-reinstall "manas-cli[gguf]"'
        ) from None
    return gguf


def _list(fields: dict, key: str, path: Path) -> list:
    value = fields.get(key)
    if value is None:
        raise TokenizerError(f"{path}: its GGUF metadata has no {key}")
    if not isinstance(value, list):
        raise TokenizerError(f"{path}: its GGUF metadata's {key} is not a list")
    return value


def _strings(fields: dict, key: str, path: Path) -> list[str]:
    value = _list(fields, key, path)
    if not all(isinstance(item, str) for item in value):
        raise TokenizerError(f"{path}: its GGUF metadata's {key} is not a list of strings")
    return value


def string_field(fields: dict, key: str, path: Path, error: type[Exception] = TokenizerError) -> str:
    """A GGUF metadata field that must be a string; `error` (naming the file and the key) where it is not."""
    value = fields.get(key)
    if not isinstance(value, str):
        raise error(f"{path}: its GGUF metadata has no string {key}")
    return value


def _integer(fields: dict, key: str) -> int | None:
    return value if type(value := fields.get(key)) is int else None
