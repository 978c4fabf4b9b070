"""`manas tokenize`: a text's token ids as a model's tokenizer gives them (llama.cpp's llama-tokenize), to check a
tokenizer against another tool."""

from __future__ import annotations

from pathlib import Path

from ...errors import InputError
from .common import checkpoint_given, read_stdin


def run(*, source: Path | None, text: str | None, special: bool, json_output: bool, jsonl: bool) -> None:
    """TEXT's ids (standard input's without it); with jsonl, each line of standard input a JSON string, and a line
    of ids for each (a test file of many texts in one run)."""
    from ...formats.tokenizer import encode_text

    if text is not None and jsonl:
        raise InputError("--jsonl reads its texts from standard input: give no TEXT")
    encoding = source_encoding(source)
    if text is None:
        text = read_stdin("tokenize a shorter text, or split it")
    for one in _jsonl_texts(text) if jsonl else [text]:
        print(_ids_line(encoding, encode_text(encoding, one, special), json_output))


def _ids_line(encoding, ids: list[int], json_output: bool) -> str:
    from ...records import json_line

    if not json_output:
        return " ".join(map(str, ids))
    pieces = [encoding.decode_single_token_bytes(token).decode("utf-8", "replace") for token in ids]
    return json_line({"ids": ids, "pieces": pieces})


def _jsonl_texts(lines: str) -> list[str]:
    from ...settings import strict_json

    texts = []
    for number, line in enumerate(lines.splitlines(), start=1):
        try:
            value = strict_json(line)
        except (ValueError, RecursionError) as exc:
            raise InputError(f"line {number} of standard input is not JSON: {exc}") from None
        if not isinstance(value, str):
            raise InputError(f"line {number} of standard input is not a JSON string")
        texts.append(value)
    return texts


def source_encoding(source: Path | None):
    """The tokenizer of a Hugging Face tokenizer.json, or of a checkpoint (a path or a store name; none: the
    default model), read from its header alone."""
    from ...formats.tokenizer import build_encoding, read_tokenizer_text, spec_from_tokenizer_json

    if source is not None and source.suffix == ".json":
        return build_encoding(spec_from_tokenizer_json(read_tokenizer_text(source, source), source))
    if source is not None and (source.suffix == ".model" or source.name.startswith("tokenizer.model")):
        from ...formats.sentencepiece import spec_from_model_file

        return build_encoding(spec_from_model_file(source))
    if source is not None and source.suffix == ".gguf":
        from ...formats.gguf_vocab import spec_from_gguf

        return build_encoding(spec_from_gguf(source))
    from ...formats.header import read_header

    path = checkpoint_given(None, source)
    with path.open("rb") as f:
        return read_header(f, path).encoding
