"""`manas generate --jsonl`: many requests in one process, one JSON object per line in, one record per line out,
in input order, decoded together by continuous batching."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, ManasError, interrupt_exit_code
from ..settings import GenerationSettings, with_overrides
from .common import ModelOptions, check_memory, encode_prompt, load_model, require_stdout


@dataclass
class Line:
    """One input line: its request, or why it has none."""

    number: int
    id: object
    settings: GenerationSettings | None = None
    prompt: str | None = None
    error: str | None = None
    record: dict | None = None  # once done


def parse_line(number: int, text: str, defaults: GenerationSettings) -> Line:
    """A line's request: `prompt`, optionally `id`, and any setting by its name; the flags give the defaults."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return Line(number, number, error=f"not JSON: {exc}")
    if not isinstance(value, dict):
        return Line(number, number, error=f"not a JSON object but {type(value).__name__}")
    key = value.pop("id", number)
    if not isinstance(value.get("prompt"), str):
        return Line(number, key, error="no 'prompt' string")
    prompt = value.pop("prompt")
    try:
        settings = with_overrides(defaults, value)
    except ValueError as exc:
        return Line(number, key, error=str(exc))
    return Line(number, key, settings, prompt)


def read_lines(prompt_file: Path | None) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of the file or standard input, read as they come."""
    if prompt_file is not None:
        try:
            source = prompt_file.open(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot read prompt file {prompt_file}: {exc.strerror}") from None
    else:
        if sys.stdin is None:
            return
        source = sys.stdin
    with source:
        for number, text in enumerate(source, start=1):
            if text.strip():
                yield number, text


def run(*, prompt_file: Path | None, defaults: GenerationSettings, batch_size: int, overflow: str, stats: bool | None,
        quiet: bool, model_options: ModelOptions) -> None:
    import torch
    import typer

    from ..batching import Request, generate_batched
    from ..generation import GenerationStats
    from ..quantize import weights_name
    from ..render import json_line, say, stderr_console
    from ..sampling import seeded_generator
    from ..streaming import TextStream
    from ..tokenizer import decodable, end_of_text_id
    from .generate import make_sampler, sample_record

    require_stdout()
    console = stderr_console(quiet=quiet)
    show_stats = not quiet and (stats if stats is not None else sys.stderr.isatty())
    checkpoint, _ = load_model(model_options)
    model, encoding = checkpoint.model, checkpoint.encoding
    check_memory(model, batch_size, model.config.block_size, "--batch-size")
    eot, allowed = end_of_text_id(encoding), torch.tensor(decodable(encoding))
    lines: dict[int, Line] = {}  # by number, until written
    order: list[int] = []  # the line numbers read, in order
    streams: dict[int, TextStream] = {}
    progress: dict[int, GenerationStats] = {}
    seeds: dict[int, int] = {}
    written = failed = 0

    def requests() -> Iterator[Request]:
        for number, text in read_lines(prompt_file):
            line = lines[number] = parse_line(number, text, defaults)
            order.append(number)
            if line.error is None:
                try:
                    ids = encode_prompt(checkpoint, line.prompt, console)
                except ManasError as exc:  # a character outside a character vocabulary
                    line.error = str(exc)
            if line.error is not None:
                line.record = {"id": line.id, "line": number, "error": line.error}
                flush()
                continue
            settings = line.settings
            generator, seeds[number] = seeded_generator(settings.seed, model)
            streams[number] = TextStream(encoding, eot, settings.stop, record=True)
            progress[number] = GenerationStats(prompt_tokens=len(ids))
            yield Request(number, ids, make_sampler(settings, generator, allowed), settings.max_tokens, settings.logprobs)

    def flush() -> None:
        """Write every record whose line, and all before it, is done."""
        nonlocal written, failed
        while written < len(order) and lines[order[written]].record is not None:
            line = lines.pop(order[written])
            failed += "error" in line.record
            sys.stdout.write(json_line(line.record) + "\n")
            written += 1
        sys.stdout.flush()

    def complete(number: int) -> None:
        """The request's record: ended by its budget, unless end-of-text or a stop string ended it first."""
        stream, line = streams.pop(number), lines[number]
        stream.finish("length")
        record = sample_record(stream, progress.pop(number), {}, seeds.pop(number), weights_name(model), line.settings)
        del record["cache"]  # the rows' caches are gone with them; their sizes say nothing per request
        line.record = {"id": line.id, **record}

    interruption = None
    steps = generate_batched(model, requests(), batch_size, eot, overflow, finished=lambda n: streams[n].finished)
    try:
        for tokens in steps:
            for made in tokens:
                stream = streams[made.key]
                progress[made.key].update(made)
                stream.feed(made.token, made.logprobs)
                if made.last or stream.finished:
                    complete(made.key)
            flush()
    except KeyboardInterrupt as exc:
        interruption = exc
    finally:
        steps.close()
    if interruption is not None:
        raise typer.Exit(interrupt_exit_code(interruption))
    if show_stats:
        say(console, f"{written:,} requests, {failed:,} failed · batch size {batch_size}")
    if failed:
        console.print(f"error: {failed} of {written} lines failed (their records have an 'error' field)")
        raise typer.Exit(1)
