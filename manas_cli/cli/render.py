"""Presentation: Rich consoles, progress displays and tables. Numbers in, text out; no engine work here."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from ..records import json_line
from .interrupts import held


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
    return (
        f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else f"{seconds // 60}:{seconds % 60:02d}"
    )


@contextmanager
def train_progress(console: Console, total_steps: int, start_step: int) -> Iterator:
    """A progress bar on a terminal; a line per evaluation elsewhere. Yields a function taking TrainEvents."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

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


class Output:
    """stdout, the product: streamed text for one sample, whole samples for several, or JSON lines.

    hold_lines (a live display on the same terminal) keeps the streamed text back until release(): the display
    writes the complete lines between its frames, so they never cut through its region.
    """

    def __init__(self, stream, json_lines: bool, samples: int, hold_lines: bool = False) -> None:
        self.stream = stream
        self.json_lines = json_lines
        self.live = samples == 1 and not json_lines  # several samples decode together: print each when done
        self.hold_lines = hold_lines
        self.held = ""

    def text(self, row: int, piece: str) -> None:
        if self.live and piece:
            self.held += piece
            if not self.hold_lines:
                self.release(whole=True)

    def release(self, whole: bool = False) -> None:
        """Write the text held back: its complete lines, or all of it."""
        cut = len(self.held) if whole else self.held.rfind("\n") + 1
        if cut:
            # Take the text before writing it: a Ctrl-C during the write must not leave it to be written again.
            ready, self.held = self.held[:cut], self.held[cut:]
            self.stream.write(ready)
            self.stream.flush()

    def has_lines(self) -> bool:
        """Whether complete lines of text are held back."""
        return "\n" in self.held

    def close_text(self, texts: list[str], echo: str | None) -> None:
        """End the text: one newline after a streamed sample; several samples apart by a blank line (and a rule
        on a terminal)."""
        if self.live:
            rest, self.held = self.held, ""
            self.stream.write(rest + "\n")
        else:
            rule = self._rule() if self.stream.isatty() else ""
            self.stream.write(("\n" + rule + "\n").join((echo or "") + text for text in texts) + "\n")
        self.stream.flush()

    def json_line(self, record: dict) -> None:
        self.stream.write(json_line(record) + "\n")
        self.stream.flush()

    def _rule(self) -> str:
        import shutil

        return "─" * min(80, shutil.get_terminal_size().columns) + "\n"


def format_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:,} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def recompute_explanation(block_size: int) -> str:
    """Why generation slows past the window in the exact mode, and the way out."""
    return (
        f"each further token re-prefills all {block_size} positions, exactly as crop-and-recompute; "
        "--overflow shift is faster but no longer identical to it"
    )


def recompute_notice(block_size: int) -> str:
    return f"notice: the context window is full: {recompute_explanation(block_size)}"


def generation_stats_line(stats, storage: dict, seed: int | None = None) -> str:
    """The final stats: with several samples, the rates are totals over all of them, and say so."""
    samples = f" × {stats.batch_size} samples" if stats.batch_size > 1 else ""
    total = " total" if stats.batch_size > 1 else ""
    return (
        f"prompt {plural(stats.prompt_tokens, 'token')} · generated {stats.generated_tokens}{samples} · "
        f"ttft {stats.ttft_s * 1000:.0f} ms · prefill {stats.prefill_tokens_per_s:,.0f} tok/s{total} · "
        f"decode {stats.decode_tokens_per_s:,.1f} tok/s{total} · re-prefills {stats.re_prefills} · "
        f"cache {plural(storage['positions'], 'position')}, {format_bytes(storage['storage_bytes'])}"
        + (f" · accepted {stats.accepted_tokens}/{stats.proposed_tokens} proposed" if stats.proposed_tokens else "")
        + (f" · seed {seed}" if seed is not None else "")
    )


@contextmanager
def token_progress(console: Console, total: int, description: str, unit: str = "tokens") -> Iterator:
    """On a terminal, a bar over `total` tokens (or other units) with the elapsed time, the rate and an estimate of
    what is left, redrawn ten times a second; yields the callback to call after each token (or several), which may
    give a new description."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,}/{task.total:,} " + unit),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=True,
    )
    task = progress.add_task(description, total=total, rate="")

    def advance(label: str | None = None, tokens: int = 1) -> None:
        progress.update(task, advance=tokens, **({"description": label} if label else {}))
        speed = progress.tasks[task].speed
        progress.update(task, rate="" if speed is None else f"{speed:,.1f}/s")

    with progress:
        yield advance


STEP_SILENT_S = 1.0  # a step over this long is shown (a quick one never flashes a spinner, nor adds a line)


@contextmanager
def activity(console: Console | None, pipe: bool = True) -> Iterator:
    """Yields show(what), to call as each step that can take long begins (loading, converting, compiling). A step
    still running after STEP_SILENT_S is shown: on a terminal as a transient spinner with the step and its elapsed
    time (later steps then replace its text at once), on a pipe as a line on stderr (unless not `pipe`: a command
    whose whole work is that step, as convert's, says what it did when it is done, or one error line). A quick step
    says nothing."""
    import threading

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if console is None:
        yield lambda what: None
        return
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True
    )
    shown: list = []  # the spinner's task, once it is on the screen
    timer = None

    def appear(what: str) -> None:
        if not console.is_terminal:
            if pipe:
                say(console, f"{what}...")
        elif not shown:
            progress.start()
            shown.append(progress.add_task(what))

    def show(what: str) -> None:
        nonlocal timer
        if timer is not None:
            timer.cancel()
        if shown:
            progress.reset(shown[0], description=what)
            return
        timer = threading.Timer(STEP_SILENT_S, appear, (what,))
        timer.daemon = True
        timer.start()

    try:
        yield show
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
        if shown:
            progress.stop()


# A figure whose runs spread more than this (standard deviation over mean) is marked: it measures the machine's
# load more than manas.
NOISY_SPREAD = 0.10


def is_noisy(test: dict) -> bool:
    return test["tokens_per_s_mean"] > 0 and test["tokens_per_s_std"] > NOISY_SPREAD * test["tokens_per_s_mean"]


def noise_warning(report: dict) -> str | None:
    """What to do about noisy figures, for stderr; None when every figure held still."""
    noisy = [test for test in report["tests"] if is_noisy(test)]
    if not noisy:
        return None
    spreads = ", ".join(f"{t['name']} ±{t['tokens_per_s_std'] / t['tokens_per_s_mean']:.0%}" for t in noisy)
    return (
        f"warning: runs varied by more than {NOISY_SPREAD:.0%} ({spreads}): these figures are noise more than "
        "speed; run on a quieter machine, with --threads 1 on a busy one, or with more --repeat"
    )


def say(console: Console, message: str) -> None:
    """A line of talk on stderr: wrapped at words on a terminal (the terminal itself would cut mid-word), one line
    for a pipe or a file. Written whole, a Ctrl-C or not (interrupts.held)."""
    with held():
        console.print(message, soft_wrap=not console.is_terminal)


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


class BenchRows:
    """bench's report on stdout as it is measured, each line flushed whole (a pipe gets each row as it finishes,
    and a Ctrl-C keeps those printed): the model above, a row per test, the totals below."""

    def __init__(self, report: dict, prompt_tokens: int, tokens: int) -> None:
        model = report["model"]
        self.width = len(f"tg{tokens} no-cache @ d{report['depth']}" if report["depth"] else f"tg{tokens} no-cache")
        self.repeat = report["repeat"]
        self._line(model["path"])
        self._line(
            f"{model['parameters']:,} parameters · {model['weights']} weights {format_bytes(model['weights_bytes'])} · "
            f"block_size {model['block_size']} · {model['engine']} engine · {model['device']} · {model['dtype']} · "
            f"{plural(model['threads'], 'thread')} ({model['threads_rule']}) · "
            f"batch {report['batch']} · {plural(report['repeat'], 'run')} · overflow {report['overflow']}"
        )
        self._line("")
        self._line(f"{'test':<{self.width}}  {'tokens/s':>20}")

    def row(self, test: dict) -> None:
        figure = f"{test['tokens_per_s_mean']:,.1f}"
        if self.repeat > 1:  # one run has no spread to show
            figure += f" ± {test['tokens_per_s_std']:,.1f}"
        self._line(f"{test['name']:<{self.width}}  {figure:>20}" + ("  noisy" if test["noisy"] else ""))

    def footer(self, report: dict) -> None:
        speedup = f"{report['speedup']:.1f}×" if report["speedup"] is not None else "-"
        if report["speedup"] is not None and any(test["noisy"] for test in report["tests"][1:]):
            speedup += " (noisy)"
        self._line("")
        self._line(
            f"time to first token {report['ttft_s'] * 1000:.1f} ms · cache speed-up {speedup} · "
            f"re-prefills {report['re_prefills']} · peak memory {format_bytes(report['peak_memory_bytes'])} · "
            f"cache {format_bytes(report['cache_bytes'])}"
        )
        if (spec := report.get("speculation")) is not None:
            self._line(
                f"speculation: accepted {spec['accepted_tokens']}/{spec['proposed_tokens']} proposed "
                f"({spec['acceptance_rate']:.0%}) · {spec['tokens_per_check']:.2f} tokens per check · "
                f"{spec['speedup']:.2f}× tg"
            )

    @staticmethod
    def _line(text: str) -> None:
        with held():
            sys.stdout.write(text + "\n")
            sys.stdout.flush()


def bar(fraction: float, width: int = 30) -> str:
    """A horizontal bar in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    return "█" * (eighths // 8) + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[eighths % 8]


def sweep_chart(rows: list[dict]):
    from rich.table import Table

    fastest = max(row["tokens_per_s"] for row in rows)
    table = Table(title="decode speed by context position", box=None, pad_edge=False)
    for column, justify in (("positions", "left"), ("tokens/s", "right"), ("", "left"), ("re-prefills", "right")):
        table.add_column(column, justify=justify)
    for row in rows:
        table.add_row(
            f"{row['start']}–{row['end'] - 1}",
            f"{row['tokens_per_s']:,.1f}",
            bar(row["tokens_per_s"] / fastest),
            str(row["re_prefills"]),
        )
    return table


def ranges(numbers: list[int]) -> str:
    """[3, 4, 5, 9] -> '3–5, 9'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}–{b}" if b > a else str(a) for a, b in spans)


def cache_view(report: dict, header: dict):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    fill = report["positions"] / report["block_size"]
    lines = [
        Text(f"{header['checkpoint']}"),
        Text(
            f"{header['n_layer']} layers · {header['n_head']} query heads · {header['n_kv_head']} kv heads · "
            f"head size {header['head_size']} · {report['dtype']} · {header['device']} · "
            f"{header['weights']} weights {format_bytes(header['weights_bytes'])}"
        ),
        Text(f"positions {report['positions']}/{report['block_size']} {bar(fill, 40):<40} {fill:.0%}"),
        Text(""),
    ]
    windows = any(layer["window"] is not None for layer in report["layers"])
    table = Table(box=None, pad_edge=False)
    columns = [("layer", "right"), ("K shape", "left"), ("V shape", "left"), ("dtype", "left"), ("bytes", "right")]
    for column, justify in columns + ([("window", "right"), ("in window", "right")] if windows else []):
        table.add_column(column, justify=justify)
    for layer in report["layers"]:
        cells = [str(layer["layer"]), str(tuple(layer["k_shape"])), str(tuple(layer["v_shape"])), report["dtype"]]
        cells.append(f"{layer['bytes']:,}")
        if windows:
            cells += [f"{layer['window']:,}" if layer["window"] else "all", f"{layer['window_bytes']:,}"]
        table.add_row(*cells)
    saving = 1 - report["logical_bytes"] / report["mha_equivalent_bytes"] if report["mha_equivalent_bytes"] else 0.0
    totals = [
        f"logical {format_bytes(report['logical_bytes'])} · allocated {format_bytes(report['storage_bytes'])} · "
        f"{report['allocation']}",
        f"{format_bytes(report['bytes_per_position'])} per position · "
        f"{format_bytes(report['full_window_bytes'])} at a full window of {report['block_size']}",
    ]
    if header["n_kv_head"] != header["n_head"]:
        totals.append(
            f"a multi-head cache would hold {format_bytes(report['mha_equivalent_bytes'])}: "
            f"grouped-query attention saves {saving:.0%}"
        )
    if windows and report["logical_bytes"]:
        share = report["window_bytes"] / report["logical_bytes"]
        totals.append(
            f"sliding windows: the layers attend over {format_bytes(report['window_bytes'])} of it ({share:.0%}); "
            "the cache keeps every position, so a re-prefill's window stays exact"
        )
    if report["re_prefill_positions"]:
        totals.append("re-prefills at sequence positions " + ranges(report["re_prefill_positions"]))
        totals.append(recompute_explanation(report["block_size"]))
    return Group(*lines, table, Text(""), *map(Text, totals))


def plain_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns aligned by spaces, as `ollama list` prints them: readable on a terminal, cut by awk in a pipe."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [headers, *rows]
    )
