"""The live display of `manas generate` on a terminal: a status line on stderr (and, for several samples, one region
per sample growing above it), redrawn below the streamed text at most ten times a second and erased at the end.
It needs stderr on a terminal and stdout on a terminal or in a file (see piped()).

When stdout is the same terminal, the text's complete lines are written to stdout between erasing the region and
drawing it again, so text and status never interleave, and the line still being written shows in the region. The
bytes of stdout are those written without the display; only the moment they are written changes.
"""

from __future__ import annotations

import os
import stat
import time
import unicodedata
from collections.abc import Callable

from rich.cells import chop_cells
from rich.console import Console
from rich.text import Text

from .render import Output, bar, format_bytes

REFRESH_S = 0.1  # at most ten frames a second
BAR_CELLS = 10
# Rich's Live draws with the same codes: the cursor hides while the region is up, each frame erases the last one
# from its bottom row up. A frame is one synchronized update (mode 2026), so a terminal never shows half of one.
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
BEGIN_FRAME, END_FRAME = "\x1b[?2026h", "\x1b[?2026l"
ERASE_LINE, CURSOR_UP = "\x1b[2K", "\x1b[1A"


class LiveDisplay:
    """Draws the region from the run's own state (the text streams, the stats, the cache's storage) when update()
    finds a frame due; notice() adds a line to it, printed for good once the text is out (keep_notices)."""

    def __init__(self, console: Console, out: Output, streams: list, stats, max_tokens: int, block_size: int,
                 storage: Callable[[], dict]) -> None:
        self.console = console
        self.out = out
        self.streams = streams
        self.stats = stats
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.storage = storage
        self.notices: list[str] = []
        self._rows = 0  # rows the last frame drew; the cursor is at the end of its last one
        self._drawn_at: float | None = None

    def __enter__(self) -> LiveDisplay:
        self._write(HIDE_CURSOR)
        return self

    def __exit__(self, error_type, *_) -> None:
        """Draw the final state (as Rich's Live does when it stops), then erase the region for good; after a
        failure, the text held back goes out as it would have without the display."""
        if error_type is None:
            self.frame()
        self._write(BEGIN_FRAME + self._erase() + SHOW_CURSOR + END_FRAME)
        self._rows = 0
        if error_type is not None:
            self.out.release(whole=True)

    def update(self) -> None:
        if self._drawn_at is None or time.monotonic() - self._drawn_at >= REFRESH_S:
            self.frame()

    def notice(self, message: str) -> None:
        self.notices.append(message)

    def keep_notices(self) -> None:
        for message in self.notices:
            self.console.print(message)

    def frame(self) -> None:
        width, height = self.console.size
        self._write(BEGIN_FRAME + self._erase())
        self.out.release()  # the text's complete lines go out above the region
        rows = self._region(width, height)
        with self.console.capture() as capture:
            self.console.print(*rows, sep="\n", end="")
        self._write(capture.get() + END_FRAME)
        self._rows = len(rows)
        self._drawn_at = time.monotonic()

    def _region(self, width: int, height: int) -> list[Text]:
        wrap = width - 1  # rows end short of the last column, where a terminal would hold the cursor pending a wrap
        status = status_line(self.stats, self.max_tokens, self.storage(), self.block_size).wrap(self.console, wrap)
        notices = [row for message in self.notices for row in Text(message, style="yellow").wrap(self.console, wrap)]
        room = max(0, height - 1 - len(status) - len(notices))  # one row spare: a full screen would scroll
        if len(self.streams) > 1:
            body = sample_rows(self.streams, width, room)
        else:
            body = [Text(row) for row in fold(self.out.held, width)[-max(1, room // 2):] if row]
        rows = [*body, *notices, *status]
        for row in rows:
            row.truncate(width)  # a row wider than the terminal would wrap, and the erase would miss its rest
        return rows

    def _erase(self) -> str:
        """From the end of the last frame's bottom row to the start of its top row, erasing each."""
        return "\r" + ERASE_LINE + (CURSOR_UP + ERASE_LINE) * (self._rows - 1) if self._rows else ""

    def _write(self, codes: str) -> None:
        self.console.file.write(codes)
        self.console.file.flush()


def status_line(stats, max_tokens: int, storage: dict, block_size: int) -> Text:
    samples = f" × {stats.batch_size}" if stats.batch_size > 1 else ""
    rate = f"{stats.decode_tokens_per_s:,.1f} tok/s" if stats.decode_steps else "- tok/s"
    fill = storage["positions"] / block_size
    return Text.assemble(
        (f"{stats.generated_tokens}/{max_tokens}", "bold"), f" tokens{samples} · {rate} · ",
        f"re-prefills {stats.re_prefills} · cache ", ("▕" + f"{bar(fill, BAR_CELLS):<{BAR_CELLS}}" + "▏", "cyan"),
        f" {storage['positions']}/{block_size} · {format_bytes(storage['logical_bytes'])} logical, "
        f"{format_bytes(storage['storage_bytes'])} allocated",
    )


def sample_rows(streams: list, width: int, room: int) -> list[Text]:
    """A header and the last rows of each sample's text, as many samples as the room holds."""
    shown = max(1, min(len(streams), room // 2))
    per_sample = max(1, room // shown - 1)
    rows = []
    for index, stream in enumerate(streams[:shown]):
        state = f" · {stream.finish_reason}" if stream.finished else ""
        rows.append(Text(f"── sample {index + 1} · {stream.count} tokens{state} ", style="dim"))
        rows.extend(Text(row) for row in fold(stream.text, width)[-per_sample:])
    if shown < len(streams):
        rows.append(Text(f"── and {len(streams) - shown} more samples", style="dim"))
    return rows


def fold(text: str, width: int) -> list[str]:
    """Terminal rows of the text at this width, as a terminal wraps them (by cells, not words); control characters
    that would move the cursor are left out, as the region's row count must be exact."""
    visible = "".join(ch for ch in text.replace("\t", " ") if ch == "\n" or unicodedata.category(ch) != "Cc")
    return [row for line in visible.split("\n") for row in (chop_cells(line, width) or [""])]


def shares_terminal(stdout, stderr) -> bool:
    """stdout is the very terminal the display draws on (not a pipe, a file or another terminal)."""
    return stdout.isatty() and os.path.sameopenfile(stdout.fileno(), stderr.fileno())


def piped(stdout) -> bool:
    """stdout goes to a pipe or a socket, whose reader (head, tee, less) may write to the terminal the display
    draws on: the region would then erase or garble what that reader shows, so there is none."""
    mode = os.fstat(stdout.fileno()).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
