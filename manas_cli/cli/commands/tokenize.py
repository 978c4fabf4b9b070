"""`manas tokenize`: a text's token ids as a model's tokenizer gives them (llama.cpp's llama-tokenize), to check a
tokenizer against another tool."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ...errors import InputError
from ..flags import checkpoint_option


def run(*, source: Path | None, text: str | None, special: bool, json_output: bool, jsonl: bool) -> None:
    """TEXT's ids (standard input's without it); with jsonl, each line of standard input a JSON string, and a line
    of ids for each (a test file of many texts in one run)."""
    from ...formats.tokenizer import encode_text
    from .common import read_stdin

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
    from .common import checkpoint_given

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


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(
    text: Annotated[
        Optional[str], typer.Argument(help="The text; standard input without it.", show_default=False)
    ] = None,
    source: checkpoint_option(
        "A checkpoint, a store name, a Hugging Face tokenizer.json, or a GGUF file (a model, or a vocabulary alone "
        "as llama.cpp's ggml-vocab-*.gguf)."
    ) = None,
    special: Annotated[
        bool,
        typer.Option(
            "--special/--no-special",
            help="Special-token text (<|im_start|>) as those tokens, as a prompt's; --no-special: plain text.",
        ),
    ] = True,
    json_output: Annotated[
        bool, typer.Option("--json", help='One JSON object: {"ids": [...], "pieces": [...]}, each id\'s text.')
    ] = False,
    jsonl: Annotated[
        bool,
        typer.Option("--jsonl", help="Each line of standard input a JSON string: a line of ids for each, in order."),
    ] = False,
) -> None:
    """Print a text's token ids, space-separated on one line, as the model's tokenizer gives them.

    llama.cpp's llama-tokenize, for checking a tokenizer against another tool. No BOS is added: these are the
    text's own ids (a prompt of a model that has one begins with its BOS).

    Examples:

      manas tokenize -m smollm2-135m-instruct "Hello world"

      manas tokenize -c tokenizer.json --json < text.txt

      jq -R . lines.txt | manas tokenize -c ggml-vocab-qwen2.gguf --jsonl --no-special
    """

    run(source=source, text=text, special=special, json_output=json_output, jsonl=jsonl)
