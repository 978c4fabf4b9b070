"""Presentation: Rich consoles, progress displays and tables. Numbers in, text out; no engine work here."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


def stderr_console(quiet: bool = False) -> Console:
    """Talk goes to stderr; colour and live displays only on a terminal, never with NO_COLOR."""
    return Console(
        file=sys.stderr,
        no_color=bool(os.environ.get("NO_COLOR")),
        highlight=False,
        quiet=quiet,
        force_terminal=None,
        soft_wrap=True,
    )


def error_line(message: str) -> str:
    """One line, no escape codes: whatever an exception carried (torch's messages hold ANSI codes)."""
    import re

    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", message)
    return "error: " + " ".join(plain.split())


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


@contextmanager
def train_progress(console: Console, total_steps: int, start_step: int) -> Iterator:
    """A progress bar on a terminal; a line per evaluation elsewhere. Yields a function taking TrainEvents."""
    live = console.is_terminal
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not live,
    )
    task = progress.add_task("train", total=total_steps, completed=start_step, status="")
    best: list[str] = ["-"]

    def show(event) -> None:
        if event.val_loss is not None:
            best[0] = f"{event.val_loss:.3f} ({event.val_loss_per_char:.3f}/char)"
            saved = "  saved" if event.saved else ""
            console.print(
                f"step {event.step}/{total_steps}  train {event.train_loss:.4f}  val {event.val_loss:.4f} nats/token "
                f"{event.val_loss_per_char:.4f} nats/char  {event.tokens_per_s:,.0f} tok/s  "
                f"elapsed {format_seconds(event.elapsed_s)}  left {format_seconds(event.eta_s)}{saved}"
            )
        status = f"train {event.train_loss:.3f}  val {best[0]}  {event.tokens_per_s:,.0f} tok/s"
        progress.update(task, completed=event.step, status=status)

    with progress:
        yield show
