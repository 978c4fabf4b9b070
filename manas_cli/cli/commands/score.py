"""`manas score`: a model's loss on a text, per token and per character, and its perplexity."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...errors import InputError
from ..flags import JsonOption, takes_model_flags

if TYPE_CHECKING:
    from ...models import ModelOptions


def run(*, text_file: Path | None, stride: int | None, json_output: bool, model_options: "ModelOptions") -> None:
    import sys

    from ...records import checked_stride, json_line, score_record, scored_ids
    from ..render import stderr_console, token_progress
    from .common import load_model, require_stdout

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
    from .common import read_stdin, read_text_file

    if text_file is not None and str(text_file) != "-":
        return read_text_file(text_file, "text file", SCORE_ADVICE)
    text = read_stdin(SCORE_ADVICE)
    if not text.strip():
        raise InputError("standard input is empty: pass the text to score")
    return text


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags(cache=False)
def command(
    text_file: Annotated[
        Optional[Path], typer.Argument(help="UTF-8 text to score; '-' or none reads standard input.")
    ] = None,
    stride: Annotated[
        Optional[int],
        typer.Option(
            help=(
                "Tokens each window advances by (default: half the window); every token is scored once, after up to "
                "block_size - stride tokens of context."
            )
        ),
    ] = None,
    json_output: JsonOption = False,
    *,
    model_options: "ModelOptions",
) -> None:
    """Score a text with a model: its loss in nats per token and per character, and its perplexity.

    A window of block_size tokens slides over the text by --stride, as Hugging Face's perplexity guide does: every
    token is scored once (llama.cpp's llama-perplexity scores other tokens, so its figures differ). Compare a
    converted, quantized or retrained checkpoint on the same text.

    Examples:

      manas score held-out.txt

      manas score held-out.txt --quantize int8 --json | jq .nats_per_char

      cat notes.txt | manas score -c gpt2.safetensors --stride 512
    """

    run(text_file=text_file, stride=stride, json_output=json_output, model_options=model_options)
