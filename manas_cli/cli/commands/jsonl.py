"""`manas generate --jsonl`: many requests in one process, one JSON object per line in, one record per line out,
in input order, decoded together by continuous batching."""

from __future__ import annotations

import io
import queue
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...errors import InputError, ManasError, interrupt_exit_code
from ..settings import GenerationSettings, strict_json, with_overrides
from ...models import ModelOptions
from .common import check_memory, encode_prompt, load_model, require_stdout


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
        value = strict_json(text)
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


# A line longer than this is refused with an error record and skipped, so endless input without a newline cannot
# take the machine's memory (a prompt is encoded from at most PROMPT_TAIL_CHARS characters anyway).
MAX_LINE_BYTES = 8 * 2**20


@dataclass(frozen=True)
class RawLine:
    """A non-blank input line as read: its text, or why it has none (not UTF-8, too long)."""

    number: int
    text: str | None
    error: str | None = None


def read_raw_lines(source: BinaryIO) -> Iterator[RawLine]:
    """Each non-blank line, split at \\n only (as `sed -n Np` and `wc -l` count them), at most MAX_LINE_BYTES."""
    number = 0
    while data := source.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(data) > MAX_LINE_BYTES and not data.endswith(b"\n"):
            yield RawLine(number, None, f"the line is over {MAX_LINE_BYTES // 2**20} MiB: shorten its prompt")
            while (rest := source.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass  # the rest of the line is skipped as it comes (an endless one never fills memory)
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield RawLine(number, None, f"not JSON: not UTF-8 (byte {exc.start + 1} of the line): send UTF-8")
            continue
        if text.strip():
            yield RawLine(number, text)


class LineReader:
    """The input's lines, read by a thread as they arrive, so that decoding never waits for a line not yet sent (a
    client that writes one request and waits for its answer gets it)."""

    def __init__(self, source: BinaryIO) -> None:
        self._queue: queue.Queue[RawLine | OSError | None] = queue.Queue()
        self._ended = False
        threading.Thread(target=self._read, args=(source,), daemon=True).start()

    def _read(self, source: BinaryIO) -> None:
        try:
            with source:
                for line in read_raw_lines(source):
                    self._queue.put(line)
        except OSError as exc:
            self._queue.put(exc)
        finally:
            self._queue.put(None)

    def next(self, wait: bool) -> RawLine | None:
        """The next line; None when the input has ended, or (without wait) when no line has come yet."""
        if self._ended:
            return None
        try:
            item = self._queue.get(block=wait)
        except queue.Empty:
            return None
        if isinstance(item, OSError):
            raise InputError(f"cannot read the input: {item.strerror or item}")
        self._ended = item is None
        return item


def open_input(prompt_file: Path | None) -> BinaryIO:
    """The prompt file or standard input, as bytes (a line that is not UTF-8 gets an error record of its own)."""
    if prompt_file is None:
        return sys.stdin.buffer if sys.stdin is not None else io.BytesIO()
    try:
        return prompt_file.open("rb")
    except OSError as exc:
        raise InputError(f"cannot read prompt file {prompt_file}: {exc.strerror}") from None


def run(*, prompt_file: Path | None, defaults: GenerationSettings, batch_size: int, overflow: str, stats: bool | None,
        quiet: bool, model_options: ModelOptions) -> None:
    import typer

    from ...engine.batching import Request, generate_batched
    from ...engine.generation import GenerationStats
    from ...engine.sampling import choose_seed
    from ...formats.tokenizer import decodable, end_of_text_id
    from ..render import json_line, say, stderr_console
    from ..streaming import TextStream
    from ...engine.sampling import make_sampler
    from .generate import sample_record

    require_stdout()
    console = stderr_console(quiet=quiet)
    show_stats = not quiet and (stats if stats is not None else sys.stderr.isatty())
    source = open_input(prompt_file)
    checkpoint, _, engine = load_model(model_options, console)
    model, encoding = checkpoint.model, checkpoint.encoding
    check_memory(engine, batch_size, model.config.block_size, "--batch-size")
    eot, allowed = end_of_text_id(encoding), decodable(encoding)
    lines: dict[int, Line] = {}  # by number, until written
    order: list[int] = []  # the line numbers read, in order
    streams: dict[int, TextStream] = {}
    progress: dict[int, GenerationStats] = {}
    seeds: dict[int, int] = {}
    written = failed = 0

    reader = LineReader(source)

    def take(wait: bool) -> Request | None:
        """The next request read (see generate_batched); a line that has none gets its error record at once."""
        while (raw := reader.next(wait)) is not None:
            number = raw.number
            if raw.error is None:
                line = parse_line(number, raw.text, defaults)
            else:
                line = Line(number, number, error=raw.error)
            lines[number] = line
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
            seeds[number] = choose_seed(settings.seed)
            streams[number] = TextStream(encoding, eot, settings.stop, record=True)
            progress[number] = GenerationStats(prompt_tokens=len(ids))
            return Request(number, ids, make_sampler(settings, seeds[number], allowed, engine), settings.max_tokens,
                           settings.logprobs)
        return None

    def flush() -> None:
        """Write every record whose line, and all before it, is done."""
        nonlocal written, failed
        while written < len(order) and lines[order[written]].record is not None:
            line = lines.pop(order[written])
            failed += "error" in line.record
            sys.stdout.write(json_line(line.record) + "\n")
            written += 1
        sys.stdout.flush()

    def complete(made) -> None:
        """The request's record: ended by its budget, unless end-of-text or a stop string ended it first."""
        stream, line = streams.pop(made.key), lines[made.key]
        stream.finish("length")
        record = sample_record(stream, progress.pop(made.key), made.cache.storage(), seeds.pop(made.key),
                               engine.weights, engine.name, line.settings)
        line.record = {"id": line.id, **record}

    def fail(made) -> None:
        """The request's error record: the others go on."""
        for held in (streams, progress, seeds):
            held.pop(made.key)
        line = lines[made.key]
        line.record = {"id": line.id, "line": made.key, "error": made.error}

    interruption = None
    # A request whose stream is gone was completed (a stop string may end it before its budget).
    steps = generate_batched(engine, take, batch_size, eot, overflow, finished=lambda key: key not in streams)
    try:
        for tokens in steps:
            for made in tokens:
                if made.error is not None:
                    fail(made)
                    continue
                stream = streams[made.key]
                progress[made.key].update(made)
                stream.feed(made.token, made.logprobs)
                if made.last or stream.finished:
                    complete(made)
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
