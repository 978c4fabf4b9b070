"""Many requests in one process, one record per line in input order: generate --jsonl's lines decoded together by
continuous batching (RecordBatch), and score lines scored one by one; what `manas generate --jsonl`, `manas batch`
and the Ray Data classes (manas_cli.ray_data) all run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from .engine.batching import generate_batched
from .engine.engines import Engine
from .engine.generation import GenerationStats
from .errors import ManasError
from .records import checked_stride, sample_record, score_record, scored_ids
from .requests import Requests, encode_prompt
from .settings import GenerationSettings, strict_json, with_overrides

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


@dataclass
class Running:
    """A request being decoded: its text so far, its speed counters and its seed, for its record."""

    stream: object  # streaming.TextStream
    stats: object  # generation.GenerationStats
    seed: int
    speculates: bool = False  # its record then says what its proposals came to


class RecordBatch:
    """Lines in, records out in input order, around generate_batched (as the server's Scheduler is): take() turns
    the next line into a Request, or emits its error record at once; each step's tokens are fed to their requests'
    text; a record is emitted as soon as its line and every line before it are done. `next_line(wait)` gives the
    next line (None: none yet, or the end); `notify` hears a prompt's crop notice."""

    def __init__(
        self,
        next_line: Callable[[bool], RawLine | None],
        defaults: GenerationSettings,
        checkpoint,
        engine: Engine,
        emit: Callable[[dict], None],
        notify: Callable[[str], None] = lambda notice: None,
        draft: Engine | None = None,
    ) -> None:
        """draft: the draft model of --draft-model, for the lines that speculate with it."""
        self.next_line, self.defaults, self.checkpoint, self.notify = next_line, defaults, checkpoint, notify
        self.engine, self.requests, self.emit = engine, Requests(engine, checkpoint.encoding, draft), emit
        self.lines: dict[int, Line] = {}  # by number, until written
        self.order: list[int] = []  # the line numbers read, in order
        self.running: dict[int, Running] = {}  # by line number
        self.written = self.failed = 0

    def take(self, wait: bool):
        """The next request read (see generate_batched); a line that has none gets its error record at once."""
        while (raw := self.next_line(wait)) is not None:
            line = (
                parse_line(raw.number, raw.text, self.defaults)
                if raw.error is None
                else Line(raw.number, raw.number, error=raw.error)
            )
            self.lines[line.number] = line
            self.order.append(line.number)
            if line.error is None:
                try:
                    ids = encode_prompt(self.checkpoint, line.prompt, self.notify, line.settings.parse_special)
                    request = self.requests.prepare(line.settings)
                except ManasError as exc:  # a character outside a character vocabulary, a schema that won't compile
                    line.error = str(exc)
            if line.error is not None:
                line.record = {"id": line.id, "line": line.number, "error": line.error}
                self.flush()
                continue
            stats = GenerationStats(prompt_tokens=len(ids))
            speculates = request.proposer is not None
            self.running[line.number] = Running(request.streams[0], stats, request.seed, speculates)
            return request.request(line.number, ids)
        return None

    def finished(self, key: int) -> bool:
        """Whether the request has ended before its budget (a stop string): its record is made."""
        return key not in self.running

    def feed(self, tokens: list) -> None:
        """One step's tokens (batching.Token) to their requests; then the records that are due."""
        for made in tokens:
            if made.key not in self.running:  # ended by a stop string at an earlier token of the same check
                continue
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
        running, line = self.running.pop(made.key), self.lines[made.key]
        running.stream.finish("length")
        record = sample_record(
            running.stream, running.stats, made.cache.storage(), running.seed, self.engine, line.settings
        )
        if running.speculates:
            stats = running.stats
            record |= {"proposed_tokens": stats.proposed_tokens, "accepted_tokens": stats.accepted_tokens}
        line.record = {"id": line.id, **record}

    def fail(self, made) -> None:
        """The request's error record: the others go on."""
        del self.running[made.key]
        line = self.lines[made.key]
        line.record = {"id": line.id, "line": made.key, "error": made.error}

    def flush(self) -> None:
        """Emit every record whose line, and all before it, is done."""
        while self.written < len(self.order) and self.lines[self.order[self.written]].record is not None:
            line = self.lines.pop(self.order[self.written])
            self.failed += "error" in line.record
            self.emit(line.record)
            self.written += 1

    def run(self, batch_size: int, overflow: str) -> None:
        """Decode every line's request, `batch_size` rows at a time, until next_line ends."""
        steps = generate_batched(self.engine, self.take, batch_size, self.requests.eot, overflow, self.finished)
        try:
            for tokens in steps:
                self.feed(tokens)
        finally:
            steps.close()


def generate_records(
    checkpoint,
    engine: Engine,
    lines: Iterable[RawLine],
    defaults: GenerationSettings,
    batch_size: int,
    overflow: str = "recompute",
) -> list[dict]:
    """The records of `lines` (generate --jsonl's), in their order, decoded `batch_size` rows at a time."""
    records: list[dict] = []
    pending = iter(lines)
    RecordBatch(lambda wait: next(pending, None), defaults, checkpoint, engine, records.append).run(
        batch_size, overflow
    )
    return records


def score_line(checkpoint, engine: Engine, raw: RawLine, stride: int | None) -> dict:
    """One score line's record: `text`, optionally `id` and `stride` in; `id` and score --json's fields out, or
    `id`, `line` and `error` for a line that is bad input (not JSON, no text, a text of one token, a stride outside
    the window)."""
    key = raw.number
    try:
        if raw.error is not None:
            raise ValueError(raw.error)
        try:
            value = strict_json(raw.text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"not a JSON object but {type(value).__name__}")
        key = value.pop("id", key)
        text, line_stride = value.pop("text", None), value.pop("stride", stride)
        if not isinstance(text, str):
            raise ValueError("no 'text' string")
        if value:
            raise ValueError(f"unknown key {next(iter(value))!r} (known: text, id, stride)")
        if line_stride is not None and (not isinstance(line_stride, int) or isinstance(line_stride, bool)):
            raise ValueError(f"stride must be an integer, not {line_stride!r}")
        line_stride = checked_stride(line_stride, checkpoint.model.config.block_size)
        return {"id": key, **score_record(checkpoint, engine, scored_ids(checkpoint, text), len(text), line_stride)}
    except (ValueError, ManasError) as exc:
        return {"id": key, "line": raw.number, "error": str(exc)}
