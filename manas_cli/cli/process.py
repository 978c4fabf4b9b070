"""The process around the command line: signals, the errors a user can act on turned into one `error:` line and an
exit code, out-of-memory advice, a closed stderr repaired, and --debug, read once wherever it stands. The Typer app
(app.py) declares the commands; main() runs it."""

from __future__ import annotations

import copy
import errno
import math
import os
import sys
import warnings

import typer

from ..errors import ManasError, Terminated, interrupt_exit_code
from ..files import remove_unfinished
from . import habits, interrupts
from .app import app


def main() -> None:
    """Entry point: run the app, turning every expected failure into one `error:` line and an exit code."""
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    from typer.exceptions import Abort, Exit

    _keep_stderr_descriptor()
    try:
        args, notices = habits.translate(sys.argv[1:])
    except habits.HabitError as exc:
        _fail(str(exc), 2, False)
    for notice in notices:
        print(notice, file=sys.stderr)
    args, debug = without_debug(args)
    # torch's CPU wheel runs without NumPy (manas needs none) but warns about it at every start: noise on stderr
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    interrupts.install()
    command = typer.main.get_command(app)
    _refuse_non_finite_floats(command)
    try:
        # Not command.main(standalone_mode=False): typer's main returns an Exit's code instead of raising it (so
        # `typer.Exit(130)` after Ctrl-C ended with 0) and turns a closed pipe into sys.exit(1). The context's obj is
        # --debug, for the commands (app.model_options).
        with command.make_context("manas", args, obj=debug) as ctx:
            command.invoke(ctx)
    except Exit as exc:
        sys.exit(exc.exit_code)
    except NoArgsIsHelpError as exc:
        print(exc.format_message(), file=sys.stderr)
        sys.exit(2)
    except ClickException as exc:
        message = exc.format_message()
        if message.startswith("Got unexpected extra argument"):  # `manas generate ROMEO: and JULIET:`
            message += ': a prompt is one argument, so quote it (manas generate "ROMEO: and JULIET:") or use -p TEXT'
        if hint := OTHER_TOOLS_COMMANDS.get(message.removeprefix("No such command ").strip(".'")):
            message = f"{message.rstrip('.')}: {hint}"
        _fail(message, exc.exit_code, debug)
    except (KeyboardInterrupt, Abort) as exc:
        _fail("terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted", interrupt_exit_code(exc), debug)
    except BrokenPipeError:
        _quiet_broken_pipe()
    except ManasError as exc:
        if debug and getattr(exc, "detail", ""):  # the compiler's own message, for --engine native
            print(exc.detail.rstrip(), file=sys.stderr)
        _fail(str(exc), 1, debug)
    except (MemoryError, RuntimeError) as exc:
        if _out_of_memory(exc):
            _fail(f"out of memory: {out_of_memory_advice(args)}", 1, debug)
        _fail_unexpected(exc, debug)
    except OSError as exc:
        if exc.errno not in OS_ERRORS:
            _fail_unexpected(exc, debug)
        what, advice = OS_ERRORS[exc.errno]
        _fail(f"{exc.filename or 'a file'}: {what} ({exc.strerror}): {advice}", 1, debug)
    except Exception as exc:
        _fail_unexpected(exc, debug)
    finally:
        interrupts.cleaning_up()
        remove_unfinished()


def _refuse_non_finite_floats(command) -> None:
    """click's float flags take "nan" and "inf", which no setting means and which slip past their ranges (nan < 0
    is false): every float flag of every command refuses them, as a usage error naming the flag."""
    from typer._click.types import FloatParamType

    for param in command.params:
        if isinstance(param.type, FloatParamType) and not isinstance(param.type, _Finite):
            finite = copy.copy(param.type)  # click.FLOAT is one shared object: change a copy
            finite.__class__ = type(f"Finite{type(param.type).__name__}", (_Finite, type(param.type)), {})
            param.type = finite
    for subcommand in getattr(command, "commands", {}).values():
        _refuse_non_finite_floats(subcommand)


class _Finite:
    """Mixed into a click float type: the number converted, then refused unless finite."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if isinstance(number, float) and not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


# ollama's and llama.cpp's commands a newcomer types, and the manas command that does what they meant.
OTHER_TOOLS_COMMANDS = {
    "show": "manas list shows each model's architecture, parameters, weights, window and chat template",
    "ps": "manas keeps no model loaded between commands; manas serve holds one (GET /health says how busy)",
    "stop": "manas keeps no model loaded between commands: a server is stopped with Ctrl-C or SIGTERM",
    "cp": "copy the file manas list --json names, and run it with -m PATH",
    "create": "manas convert imports a Hugging Face folder, manas quantize makes an int8 or int4 copy",
    "completion": "manas generate -p TEXT continues a prompt (llama-completion's -n, -f, -s and --temp work too)",
}


# What each command can lower when memory runs out (its own flags only).
OUT_OF_MEMORY_ADVICE = {
    "generate": "lower --num-samples, --batch-size or --max-tokens, or use a smaller model or --quantize int8 or int4",
    "bench": "lower --batch, --tokens or --prompt-tokens, or use a smaller model or --quantize int8 or int4",
    "inspect-cache": "lower --tokens, or use a smaller model or --quantize int8 or int4",
    "score": "score a shorter text, or use a smaller model or --quantize int8 or int4",
    "train": "lower --batch-size, --block-size, --n-embd or --n-layer, or train on a shorter text",
    None: "use a smaller model, or free some memory",
}


def out_of_memory_advice(args: list[str]) -> str:
    """What the command that ran (its name is the first argument that names one) can do about it."""
    name = next((arg for arg in args if arg in OUT_OF_MEMORY_ADVICE), None)
    return OUT_OF_MEMORY_ADVICE[name]


# Failures of the system that a user can act on: (what happened, what to do).
OS_ERRORS = {
    errno.ENOSPC: ("the disk is full", "free some space, or write to another disk"),
    errno.EDQUOT: ("the disk quota is used up", "free some space, or write to another disk"),
    errno.ENAMETOOLONG: ("a file name is too long", "choose a shorter name (255 bytes at most)"),
    errno.EROFS: ("the file system is read-only", "write somewhere else"),
    errno.EACCES: ("permission denied", "check the file's and its folder's permissions, or write somewhere else"),
    errno.EIO: ("an input/output error", "check the disk or the device"),
    errno.EFBIG: (
        "the file would be larger than this process may write",
        "raise the limit (ulimit -f), or write a smaller file",
    ),
}


# Options whose next argument is a value that may itself read "--debug" (a prompt, a stop text).
def without_debug(args: list[str]) -> tuple[list[str], bool]:
    """The arguments without --debug, wherever it stands (before or after the command's name), and whether it was
    there. The root option is given back in front, where click expects it."""
    text = habits.TEXT_OPTIONS  # options whose next argument is text, which may well be "--debug"
    kept = [arg for index, arg in enumerate(args) if arg != "--debug" or (index > 0 and args[index - 1] in text)]
    debug = len(kept) < len(args)
    return (["--debug", *kept] if debug else kept), debug


def _keep_stderr_descriptor() -> None:
    """With stderr closed (`2>&-`), run as usual and say nothing: /dev/null takes descriptor 2. Python's None for
    sys.stderr would send print(file=sys.stderr) to stdout, into the text or JSON, and the next file opened would
    become descriptor 2 and receive whatever a library writes there (a Rust panic, libgomp)."""
    try:
        os.fstat(2)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 2:  # descriptor 1 was closed too, and took it
            os.dup2(devnull, 2)
            os.close(devnull)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)


def _out_of_memory(exc: BaseException) -> bool:
    """Python's MemoryError, or torch's allocators failing (its CPU allocator's RuntimeError, CUDA's
    OutOfMemoryError)."""
    return isinstance(exc, MemoryError) or "DefaultCPUAllocator" in str(exc) or "out of memory" in str(exc)


def _fail(message: str, code: int, debug: bool) -> None:
    """One `error:` line on stderr (the traceback before it with --debug), then exit."""
    from .render import error_line

    if debug:
        import traceback

        traceback.print_exc()
    print(error_line(message), file=sys.stderr)
    sys.exit(code)


def _fail_unexpected(exc: BaseException, debug: bool) -> None:
    _fail(f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)", 1, debug)


def _quiet_broken_pipe() -> None:
    """The reader went away (`| head`): exit quietly, and keep Python from complaining at shutdown."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(141)
