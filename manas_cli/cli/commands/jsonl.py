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
from ...models import ModelOptions
from ...settings import GenerationSettings, strict_json, with_overrides
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


@dataclass
class Running:
    """A request being decoded: its text so far, its speed counters and its seed, for its record."""

    stream: object  # streaming.TextStream
    stats: object  # generation.GenerationStats
    seed: int


class JsonlBatch:
    """--jsonl's reader and writer around generate_batched (as the server's Scheduler is): take() turns the next
    input line into a Request, or writes its error record at once; each step's tokens are fed to their requests'
    text; records are written in input order as soon as a line and every line before it are done."""

    def __init__(self, reader: LineReader, defaults: GenerationSettings, checkpoint, engine, console) -> None:
        from ...requests import Requests

        self.reader, self.defaults, self.checkpoint, self.console = reader, defaults, checkpoint, console
        self.engine, self.requests = engine, Requests(engine, checkpoint.encoding)
        self.lines: dict[int, Line] = {}  # by number, until written
        self.order: list[int] = []  # the line numbers read, in order
        self.running: dict[int, Running] = {}  # by line number
        self.written = self.failed = 0

    def take(self, wait: bool):
        """The next request read (see generate_batched); a line that has none gets its error record at once."""
        from ...engine.generation import GenerationStats

        while (raw := self.reader.next(wait)) is not None:
            line = (
                parse_line(raw.number, raw.text, self.defaults)
                if raw.error is None
                else Line(raw.number, raw.number, error=raw.error)
            )
            self.lines[line.number] = line
            self.order.append(line.number)
            if line.error is None:
                try:
                    ids = encode_prompt(self.checkpoint, line.prompt, self.console)
                except ManasError as exc:  # a character outside a character vocabulary
                    line.error = str(exc)
            if line.error is not None:
                line.record = {"id": line.id, "line": line.number, "error": line.error}
                self.flush()
                continue
            request = self.requests.prepare(line.settings)
            stats = GenerationStats(prompt_tokens=len(ids))
            self.running[line.number] = Running(request.streams[0], stats, request.seed)
            return request.request(line.number, ids)
        return None

    def finished(self, key: int) -> bool:
        """Whether the request has ended before its budget (a stop string): its record is made."""
        return key not in self.running

    def feed(self, tokens: list) -> None:
        """One step's tokens (batching.Token) to their requests; then the records that are due."""
        for made in tokens:
            if made.error is not None:
                self.fail(made)
                continue
            running = self.running[made.key]
            running.stats.update(made)
            running.stream.feed(made.token, made.logprobs)
            if made.last or running.stream.finished:
                self.complete(made)
        self.flush()

    def complete(self, made) -> None:
        """The request's record: ended by its budget, unless end-of-text or a stop string ended it first."""
        from ..render import sample_record

        running, line = self.running.pop(made.key), self.lines[made.key]
        running.stream.finish("length")
        record = sample_record(
            running.stream, running.stats, made.cache.storage(), running.seed, self.engine, line.settings
        )
        line.record = {"id": line.id, **record}

    def fail(self, made) -> None:
        """The request's error record: the others go on."""
        del self.running[made.key]
        line = self.lines[made.key]
        line.record = {"id": line.id, "line": made.key, "error": made.error}

    def flush(self) -> None:
        """Write every record whose line, and all before it, is done."""
        from ..render import json_line

        while self.written < len(self.order) and self.lines[self.order[self.written]].record is not None:
            line = self.lines.pop(self.order[self.written])
            self.failed += "error" in line.record
            sys.stdout.write(json_line(line.record) + "\n")
            self.written += 1
        sys.stdout.flush()


def run(
    *,
    prompt_file: Path | None,
    defaults: GenerationSettings,
    batch_size: int,
    overflow: str,
    stats: bool | None,
    quiet: bool,
    model_options: ModelOptions,
) -> None:
    import typer

    from ...engine.batching import generate_batched
    from ..render import say, stderr_console

    require_stdout()
    console = stderr_console(quiet=quiet)
    show_stats = not quiet and (stats if stats is not None else sys.stderr.isatty())
    source = open_input(prompt_file)
    checkpoint, _, engine = load_model(model_options, console)
    check_memory(engine, batch_size, engine.config.block_size, "--batch-size")
    batch = JsonlBatch(LineReader(source), defaults, checkpoint, engine, console)
    steps = generate_batched(engine, batch.take, batch_size, batch.requests.eot, overflow, finished=batch.finished)
    try:
        for tokens in steps:
            batch.feed(tokens)
    except KeyboardInterrupt as exc:
        raise typer.Exit(interrupt_exit_code(exc)) from None
    finally:
        steps.close()
    if show_stats:
        say(console, f"{batch.written:,} requests, {batch.failed:,} failed · batch size {batch_size}")
    if batch.failed:
        console.print(f"error: {batch.failed} of {batch.written} lines failed (their records have an 'error' field)")
        raise typer.Exit(1)
