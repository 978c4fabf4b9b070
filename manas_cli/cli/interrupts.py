"""Ctrl-C and SIGTERM as exceptions that unwind, so that every clean-up runs: temporary files removed, the text so
far and the stats printed, the cursor shown. Talk on stderr holds them off while it is written: Rich's console
keeps a count of the writes in progress and renders only at zero, so an exception raised inside one's end (its
`with` block's exit, before the count comes back down) would leave the count above zero, and every line after
it, the stats included, would be kept back for good."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import Terminated


def install() -> None:
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)


def cleaning_up() -> None:
    """The command is over: let no signal cut its clean-up short."""
    _state.cleaning_up = True


@contextmanager
def held() -> Iterator[None]:
    """Run the block whole: a signal that arrives in it is raised when it ends (nested holds: when the outermost
    ends). Only the main thread's blocks hold: Python runs signal handlers there, and nowhere else may raise."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.holds += 1
    try:
        yield
    finally:
        _state.holds -= 1
        if not _state.holds and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            _raise(signum)


@dataclass
class _State:
    holds: int = 0  # blocks now running under held()
    pending: int | None = None  # a signal that arrived in one, to raise when the outermost ends
    cleaning_up: bool = False  # from the first signal on (or the command's end), the handler does nothing


_state = _State()


def _raise_interrupted(signum: int, frame) -> None:
    """A second signal (a second Ctrl-C, one that `timeout` forwards) must not cut the first one's clean-up short:
    from the first on, the handler does nothing. (Not SIG_IGN: a signal already pending when the handler changes
    makes Python print a traceback.)"""
    if _state.cleaning_up:
        return
    _state.cleaning_up = True
    if _state.holds:
        _state.pending = signum
        return
    _raise(signum)


def _raise(signum: int) -> None:
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
