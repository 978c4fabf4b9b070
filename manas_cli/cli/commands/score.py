"""`manas score`: a model's loss on a text, per token and per character, and its perplexity."""

from __future__ import annotations

from pathlib import Path

import typer

from ...errors import InputError
from ...models import ModelOptions
from .common import load_model, read_stdin, read_text_file, require_stdout


def run(*, text_file: Path | None, stride: int | None, json_output: bool, model_options: ModelOptions) -> None:
    import sys

    from ...records import checked_stride, json_line, score_record, scored_ids
    from ..render import stderr_console, token_progress

    require_stdout()
    console = stderr_console()
    text = read_text(text_file)
    checkpoint, _, engine = load_model(model_options, console)
    try:
        stride = checked_stride(stride, checkpoint.model.config.block_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--stride'") from None
    ids = scored_ids(checkpoint, text)
    with token_progress(console, len(ids) - 1, "scoring") as advance:
        report = score_record(checkpoint, engine, ids, len(text), stride, lambda tokens: advance(tokens=tokens))
    if json_output:
        print(json_line(report))
        return
    print(
        f"{report['nats_per_token']:.4f} nats/token · {report['nats_per_char']:.4f} nats/char · perplexity "
        f"{report['perplexity']:,.2f} · {report['tokens']:,} tokens scored ({report['characters']:,} characters), "
        f"window {report['block_size']}, stride {stride} · {engine.weights} weights · {engine.name} engine",
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
