"""`manas generate --jsonl`: many requests in one process, one JSON object per line in, one record per line out,
in input order, decoded together by continuous batching."""

from __future__ import annotations

import io
import queue
import sys
import threading
from functools import partial
from pathlib import Path
from typing import BinaryIO

from ...batch import RawLine, read_raw_lines
from ...errors import InputError, interrupt_exit_code
from ...models import ModelOptions
from ...settings import GenerationSettings
from ..flags import DEFAULT_BATCH_SIZE
from .common import check_memory, load_model, require_stdout, speculation


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


def write_record(record: dict) -> None:
    """One record on stdout, at once: a client that writes a line and waits reads its answer."""
    from ...records import json_line

    sys.stdout.write(json_line(record) + "\n")
    sys.stdout.flush()


def rows_that_fit(engine, console) -> int:
    """The default batch's rows, DEFAULT_BATCH_SIZE or as many as the free memory holds at the model's window (a
    batched row equals the row alone, so this changes no record), said where fewer."""
    from ...engine.memory import fitting_rows
    from ..render import say

    rows = fitting_rows(engine, DEFAULT_BATCH_SIZE, engine.config.block_size)
    if rows < DEFAULT_BATCH_SIZE:
        say(
            console,
            f"notice: batch size {rows}: the free memory holds {rows} of the {engine.config.block_size:,}-token "
            f"window's rows (--batch-size sets it, --ctx keeps a shorter window)",
        )
    return rows


def run(
    *,
    prompt_file: Path | None,
    defaults: GenerationSettings,
    batch_size: int | None,
    overflow: str,
    stats: bool | None,
    quiet: bool,
    model_options: ModelOptions,
    lookup: int | None = None,
    draft_model: Path | None = None,
    draft_max: int = 4,
) -> None:
    """lookup, draft_model, draft_max: every line's speculative decoding, where its own "speculative" says
    nothing."""
    from dataclasses import replace

    import typer

    from ...batch import RecordBatch
    from ..render import say, stderr_console

    require_stdout()
    console = stderr_console(quiet=quiet)
    show_stats = not quiet and (stats if stats is not None else sys.stderr.isatty())
    source = open_input(prompt_file)
    checkpoint, _, engine = load_model(model_options, console)
    batch_size = batch_size or rows_that_fit(engine, console)
    check_memory(engine, batch_size, engine.config.block_size, "--batch-size")
    notify = partial(say, console)  # a crop notice, written whole (a Ctrl-C then keeps the stats line)
    draft, speculative = speculation(lookup, draft_model, draft_max, model_options, checkpoint, engine)
    if draft is not None:  # each row's draft keeps a cache of its own, up to the draft's window
        check_memory(draft, batch_size, draft.config.block_size, "--batch-size (each row has a draft cache too)")
    if speculative is not None:
        defaults = replace(defaults, speculative=speculative)
    batch = RecordBatch(LineReader(source).next, defaults, checkpoint, engine, write_record, notify, draft)
    try:
        batch.run(batch_size, overflow)
    except KeyboardInterrupt as exc:
        raise typer.Exit(interrupt_exit_code(exc)) from None
    if show_stats:
        say(console, f"{batch.written:,} requests, {batch.failed:,} failed · batch size {batch_size}")
    if batch.failed:
        console.print(f"error: {batch.failed} of {batch.written} lines failed (their records have an 'error' field)")
        raise typer.Exit(1)
