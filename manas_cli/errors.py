"""Exceptions a user can act on. Kept free of heavy imports: the CLI catches them without loading torch."""

import re


class ManasError(Exception):
    """An expected failure whose message tells the user what is wrong and what to do."""


class CheckpointError(ManasError):
    """A checkpoint that cannot be loaded or saved; the message names the file and what is wrong."""


class TokenizerError(ManasError, ValueError):
    """A tokenizer that cannot be built."""


class InputError(ManasError, ValueError):
    """Input data (a prompt, a training text) that cannot be used as given."""


class OutputExistsError(ManasError):
    """The output path exists and --force was not given."""


class TrainingError(ManasError):
    """Training that cannot go on: its loss diverged to NaN or infinity."""


class NumericalError(ManasError):
    """The model computed NaN or infinite values from finite weights: they overflow in the dtype it runs in."""


class ConstraintError(ManasError):
    """A constrained request's grammar could not go on (llguidance's step limits, or an internal error): that
    request fails, never the others batched with it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that every clean-up (`finally`: temporary files) runs."""


class EngineUnavailable(ManasError):
    """The engine asked for by name (--engine native) cannot run here; `detail` is the compiler's own message, shown
    with --debug."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"the native engine cannot run: {reason} (--engine auto runs the torch engine instead)")
        self.detail = detail


class MissingDependencyError(ManasError):
    """An optional package the command needs is not installed; the message says how to install it."""


def interrupt_exit_code(interrupt: BaseException) -> int:
    """What a shell reports for a process stopped by the signal: 128 + SIGTERM (15), or 128 + SIGINT (2)."""
    return 143 if isinstance(interrupt, Terminated) else 130


_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # torch's weights_only errors colour their text


def first_line(exc: BaseException, limit: int = 160) -> str:
    """A library's exception as one plain line for an `error:` message, cut at a word and marked when too long."""
    line = (_ANSI_CODES.sub("", str(exc)).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " …"
