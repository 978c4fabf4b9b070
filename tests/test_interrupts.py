"""Ctrl-C and SIGTERM while talk is written on stderr: a real signal, sent by the process to itself in the middle
of a Rich console's write, waits for the write's end. (The flaky failure this guards against: a Ctrl-C that landed
inside Rich's console left its count of writes in progress above zero, and the stats line never came out.)"""

from __future__ import annotations

import io
import os
import signal

import pytest
from rich.console import Console

from manas_cli.cli import interrupts
from manas_cli.cli.render import say
from manas_cli.errors import Terminated


@pytest.fixture(autouse=True)
def handlers(monkeypatch):
    """The CLI's handlers, with a fresh state, for one test; pytest's own handlers back afterwards."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(interrupts, "_state", interrupts._State())
    interrupts.install()
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


class SignalsMidway:
    """A renderable that sends the process a signal between its two lines, as a Ctrl-C may arrive at any point
    of a write."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __rich_console__(self, console, options):
        yield "first half"
        os.kill(os.getpid(), self.signum)
        yield "second half"


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_a_signal_during_a_line_of_talk_is_raised_after_the_whole_line(signum, raised):
    stderr = io.StringIO()
    console = Console(file=stderr, highlight=False, soft_wrap=True)
    with pytest.raises(raised):
        say(console, SignalsMidway(signum))
    assert stderr.getvalue() == "first half\nsecond half\n"
    say(console, "3 tokens · 1.0 tok/s")  # the console writes on: the stats line after the Ctrl-C comes out
    assert stderr.getvalue().endswith("second half\n3 tokens · 1.0 tok/s\n")


def test_a_signal_outside_any_held_block_is_raised_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        reached.append(True)
    assert not reached


def test_nested_holds_raise_at_the_outermost_end_and_a_second_signal_is_dropped():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.held():
            with interrupts.held():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal: the first one's clean-up goes on
            reached.append("inner end")
        reached.append("after")
    assert reached == ["inner end"]
    os.kill(os.getpid(), signal.SIGINT)  # once the clean-up has begun, signals do nothing
