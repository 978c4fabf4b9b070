"""The live display of `manas generate` on a terminal: a status line on stderr (and, for several samples, one region
per sample growing above it), redrawn below the streamed text at most ten times a second and erased at the end.
It needs stderr on a terminal and stdout on a terminal or in a file (see piped()).

When stdout is the same terminal, the text's complete lines are written to stdout between erasing the region and
drawing it again, so text and status never interleave, and the line still being written shows in the region. The
bytes of stdout are those written without the display; only the moment they are written changes.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
import unicodedata
from collections import deque
from collections.abc import Callable

from rich.cells import chop_cells
from rich.console import Console
from rich.text import Text

from .interrupts import held
from .render import Output, bar, format_bytes, plural, say

REFRESH_S = 0.1  # at most ten frames a second
BAR_CELLS = 10
# Below this size a region would crowd out the text it sits under, and a status row cut to a few cells says
# nothing: there is no live display (the text and the final stats line are the same without it).
MIN_COLUMNS, MIN_ROWS = 30, 6
DEFAULT_SIZE = (80, 24)  # a terminal that reports 0×0 (script, some containers), with no $COLUMNS/$LINES
# Rich's Live draws with the same codes: the cursor hides while the region is up, each frame erases the last one
# from its bottom row up. A frame is one synchronized update (mode 2026), so a terminal never shows half of one.
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
BEGIN_FRAME, END_FRAME = "\x1b[?2026h", "\x1b[?2026l"
ERASE_LINE, CURSOR_UP = "\x1b[2K", "\x1b[1A"
ERASE_TO_END, ERASE_BELOW = "\x1b[K", "\x1b[J"  # the rest of the row; everything after the cursor
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # the cursor home, the screen blank


class LiveDisplay:
    """Draws the region from the run's own state (the text streams, the stats, the cache's storage) when update()
    finds a frame due; notice() adds a line to it, printed for good once the text is out (keep_notices)."""

    def __init__(
        self,
        console: Console,
        out: Output,
        streams: list,
        stats,
        max_tokens: int,
        block_size: int,
        storage: Callable[[], dict],
    ) -> None:
        self.console = console
        self.out = out
        self.streams = streams
        self.stats = stats
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.storage = storage
        self.notices: list[str] = []
        self.rate = RecentRate()
        self._recent: float | None = None
        self._rows = 0  # rows the last frame drew; the cursor is at the end of its last one
        self._resized = False
        self._previous_winch = None
        self._drawn_at: float | None = None
        self.active = True  # until the display ends itself (too small a terminal, a failure to draw)

    def __enter__(self) -> LiveDisplay:
        self._write(HIDE_CURSOR)
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            self._previous_winch = signal.signal(signal.SIGWINCH, self._on_resize)
        return self

    def _on_resize(self, signum: int, frame) -> None:
        """A terminal resized (reflowing its rows, or cutting them) no longer has the region where the last frame
        left it: the next frame clears the screen and draws the region whole from its top."""
        self._resized = True

    def __exit__(self, error_type, *_) -> None:
        """Draw the final state (as Rich's Live does when it stops), then erase the region for good; after a
        failure, the text held back goes out as it would have without the display."""
        if self._previous_winch is not None:
            signal.signal(signal.SIGWINCH, self._previous_winch)
        if not self.active:
            return
        if error_type is None:
            self._drawing(self.frame)
            if not self.active:  # that last frame found the terminal too small, and ended the display
                return
        self._drawing(lambda: self._write(BEGIN_FRAME + self._erase() + SHOW_CURSOR + END_FRAME))
        self._rows = 0
        if error_type is not None:
            self.out.release(whole=True)

    def update(self) -> None:
        self._recent = self.rate.update(self.stats.decode_steps)
        if self.active and (self._drawn_at is None or time.monotonic() - self._drawn_at >= REFRESH_S):
            self._drawing(self.frame)

    def _drawing(self, draw: Callable[[], None]) -> None:
        """Draw, whole (a Ctrl-C waits for the frame's end: interrupts.held), ending the display if that fails: a
        display problem never stops a generation."""
        try:
            with held():
                draw()
        except Exception:  # any failure of the display, whatever its kind, ends only the display
            self._end(erase=False)

    def _end(self, erase: bool = True) -> None:
        """Stop drawing for the rest of the run: the region erased (the whole screen after a resize, which may
        have moved its rows), the cursor shown, the text held back written; the text goes on without a region."""
        self.active = False
        if erase and (self._rows or self._resized):
            self._write(BEGIN_FRAME + (CLEAR_SCREEN if self._resized else self._erase()) + SHOW_CURSOR + END_FRAME)
        elif erase:
            self._write(SHOW_CURSOR)  # nothing was drawn
        self._rows = 0
        self.out.hold_lines = False
        self.out.release(whole=True)

    def notice(self, message: str) -> None:
        self.notices.append(message)

    def keep_notices(self) -> None:
        for message in self.notices:
            say(self.console, message)

    def frame(self) -> None:
        """Draw the region over the last one, row by row, each row's rest erased after it is written: no row is
        ever blank between two frames. Only when complete lines of text go out above it is the region cleared
        first, for them. After a resize the terminal may have moved the old rows: everything below the cursor's
        row of the region's top is cleared."""
        width, height = self._size()
        if width < MIN_COLUMNS or height < MIN_ROWS:
            self._end()
            return
        if self._resized:
            self._resized = False
            self._write(BEGIN_FRAME + CLEAR_SCREEN)
            self._rows = 0
        if self.out.has_lines():
            self._write(BEGIN_FRAME + self._erase())
            self._rows = 0
            self.out.release()  # the text's complete lines go out above the region
        rows = self._region(width, height)
        drawn = (ERASE_TO_END + "\n").join(map(self._render, rows)) + ERASE_TO_END + ERASE_BELOW
        self._write(BEGIN_FRAME + self._to_top() + drawn + END_FRAME)
        self._rows = len(rows)
        self._drawn_at = time.monotonic()

    def _size(self) -> tuple[int, int]:
        """The size of the terminal the region is drawn on: stderr's (Rich asks stdin's or stdout's first, which
        may be another terminal, or none)."""
        return terminal_size(self.console.file.fileno())

    def _render(self, row: Text) -> str:
        with self.console.capture() as capture:
            self.console.print(row, end="")
        return capture.get()

    def _to_top(self) -> str:
        """From the end of the last frame's bottom row to the start of its top row."""
        return "\r" + CURSOR_UP * (self._rows - 1) if self._rows else "\r"

    def _region(self, width: int, height: int) -> list[Text]:
        wrap = width - 1  # rows end short of the last column, where a terminal would hold the cursor pending a wrap
        status = [status_line(self.stats, self.max_tokens, self.storage(), self.block_size, self._recent, wrap)]
        notices = [row for message in self.notices for row in Text(message, style="yellow").wrap(self.console, wrap)]
        room = max(0, height - 1 - len(status) - len(notices))  # one row spare: a full screen would scroll
        if len(self.streams) > 1:
            body = sample_rows(self.streams, width, room)
        else:
            body = [Text(row) for row in fold(self.out.held, width)[-max(1, room // 2) :] if row]
        rows = [*body, *notices, *status][-(height - 1) :]  # many notices: the newest, and the status, fit
        for row in rows:
            row.truncate(width)  # a row wider than the terminal would wrap, and the erase would miss its rest
        return rows

    def _erase(self) -> str:
        """From the end of the last frame's bottom row to the start of its top row, erasing each."""
        return "\r" + ERASE_LINE + (CURSOR_UP + ERASE_LINE) * (self._rows - 1) if self._rows else ""

    def _write(self, codes: str) -> None:
        self.console.file.write(codes)
        self.console.file.flush()


def terminal_size(fd: int) -> tuple[int, int]:
    """(columns, rows) of the terminal on fd; a size it reports as 0 (a pty nobody sized) is $COLUMNS or $LINES,
    else 80×24."""
    try:
        columns, rows = os.get_terminal_size(fd)
    except (OSError, ValueError):
        columns = rows = 0
    return columns or _env_size("COLUMNS") or DEFAULT_SIZE[0], rows or _env_size("LINES") or DEFAULT_SIZE[1]


def _env_size(name: str) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and 0 < int(value) < 10_000 else 0


def status_line(stats, max_tokens: int, storage: dict, block_size: int, rate: float | None, width: int) -> Text:
    """The run in one row that fits `width` cells: the fields that matter least go first when it is too narrow
    (the bytes, then the re-prefills, then the cache bar), and what is left is cut, never wrapped. `rate` is the
    recent decode rate, per sample when several decode together (the final stats line gives the totals)."""
    per_sample = " per sample" if stats.batch_size > 1 else ""
    fields = [  # (priority: lower is dropped first, parts)
        (
            9,
            [
                (f"{stats.generated_tokens}/{max_tokens}", "bold"),
                f" {'token' if max_tokens == 1 else 'tokens'}"
                + (f" × {stats.batch_size}" if stats.batch_size > 1 else ""),
            ],
        ),
        (8, [f"{rate:,.1f} tok/s{per_sample}" if rate is not None else f"- tok/s{per_sample}"]),
        (3, [f"re-prefills {stats.re_prefills}"]),
        (
            5,
            [
                "cache ",
                ("▕" + f"{bar(storage['positions'] / block_size, BAR_CELLS):<{BAR_CELLS}}" + "▏", "cyan"),
                f" {storage['positions']}/{block_size}",
            ],
        ),
        (1, [f"{format_bytes(storage['logical_bytes'])} logical, {format_bytes(storage['storage_bytes'])} allocated"]),
    ]
    while True:
        line = Text(" · ").join(Text.assemble(*parts) for _, parts in fields)
        if line.cell_len <= width or len(fields) == 1:
            line.truncate(width)
            return line
        fields.remove(min(fields, key=lambda field: field[0]))


class RecentRate:
    """Decode tokens per second over about the last second: the running average hides the slow-down at a full
    window for minutes."""

    WINDOW_S = 1.0

    def __init__(self) -> None:
        self._marks: deque[tuple[float, int]] = deque()  # (time, decode steps so far)

    def update(self, decode_steps: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        self._marks.append((now, decode_steps))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.WINDOW_S:
            self._marks.popleft()
        (then, before), (_, steps) = self._marks[0], self._marks[-1]
        return (steps - before) / (now - then) if steps > before and now > then else None


def sample_rows(streams: list, width: int, room: int) -> list[Text]:
    """A header and the last rows of each sample's text, as many samples as the room holds."""
    shown = max(1, min(len(streams), room // 2))
    per_sample = max(1, room // shown - 1)
    rows = []
    for index, stream in enumerate(streams[:shown]):
        state = f" · {stream.finish_reason}" if stream.finished else ""
        rows.append(Text(f"── sample {index + 1} · {plural(stream.count, 'token')}{state} ", style="dim"))
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
