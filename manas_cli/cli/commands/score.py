"""`manas score`: a model's loss on a text, per token and per character, and its perplexity."""

from __future__ import annotations

from pathlib import Path

import typer

from ...errors import InputError
from ...models import ModelOptions
from .common import load_model, read_stdin, read_text_file, require_stdout


def run(*, text_file: Path | None, stride: int | None, json_output: bool, model_options: ModelOptions) -> None:
    import sys

    from ...engine.scoring import score
    from ...formats.tokenizer import encode_long_text
    from ..render import json_line, stderr_console, token_progress

    require_stdout()
    console = stderr_console()
    text = read_text(text_file)
    checkpoint, _, engine = load_model(model_options, console)
    block_size = checkpoint.model.config.block_size
    stride = block_size // 2 if stride is None else stride
    if not 1 <= stride <= block_size:
        raise typer.BadParameter(
            f"{stride} is not in the range 1 <= stride <= {block_size} (the model's block_size)",
            param_hint="'--stride'",
        )
    ids = encode_long_text(checkpoint.encoding, text)
    if len(ids) < 2:
        raise InputError(f"the text is {len(ids)} token long: scoring needs at least 2")
    with token_progress(console, len(ids) - 1, "scoring") as advance:
        result = score(engine, ids, len(text), stride, on_window=lambda tokens: advance(tokens=tokens))
    report = {
        "nats_per_token": result.nats_per_token,
        "nats_per_char": result.nats_per_char,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        "characters": result.characters,
        "stride": stride,
        "block_size": block_size,
        "checkpoint": str(checkpoint.path),
        "weights": engine.weights,
        "engine": engine.name,
    }
    if json_output:
        print(json_line(report))
        return
    print(
        f"{result.nats_per_token:.4f} nats/token · {result.nats_per_char:.4f} nats/char · perplexity "
        f"{result.perplexity:,.2f} · {result.tokens:,} tokens scored ({result.characters:,} characters), window "
        f"{block_size}, stride {stride} · {engine.weights} weights · {engine.name} engine",
        file=sys.stdout,
    )


SCORE_ADVICE = "score a part of it (head -c 64M FILE | manas score)"


def read_text(text_file: Path | None) -> str:
    """The text file, or standard input for '-' or none."""
    if text_file is not None and str(text_file) != "-":
        return read_text_file(text_file, "text file", SCORE_ADVICE)
    text = read_stdin(SCORE_ADVICE)
    if not text.strip():
        raise InputError("standard input is empty: pass the text to score")
    return text
