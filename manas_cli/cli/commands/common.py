"""What generate, bench, inspect-cache, score, serve and train share: opening the model and saying how, reading the
prompt and texts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from ...errors import InputError
from ...models import ModelOptions, open_model

# The most text manas reads as one input (a prompt, a text to score or train on): endless input (`yes |`, a FIFO,
# /dev/zero) must not take the machine's memory. A generation encodes at most PROMPT_TAIL_CHARS of its prompt.
MAX_TEXT_BYTES = 64 * 2**20

T = TypeVar("T")


def read_bounded(source: BinaryIO, what: str, advice: str, limit: int = MAX_TEXT_BYTES) -> str:
    """At most `limit` bytes (MAX_TEXT_BYTES) of UTF-8 text from source; `what` names it and `advice` says what to
    do when it is longer."""
    data = source.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"{what} is over {limit // 2**20} MiB, the most manas reads as one text: {advice}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not valid UTF-8 (byte {exc.start}): convert it to UTF-8") from None


def read_file(path: Path, what: str, read: Callable[[BinaryIO], T]) -> T:
    """read(the open file), a file that cannot be opened or read being one InputError naming `what` it is."""
    try:
        with path.open("rb") as f:
            return read(f)
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror}") from None


def read_text_file(path: Path, what: str, advice: str, limit: int = MAX_TEXT_BYTES) -> str:
    text = read_file(path, what, lambda f: read_bounded(f, f"{what} {path}", advice, limit))
    if not text.strip():
        raise InputError(f"{what} {path} is empty")
    return text


def read_stdin(advice: str) -> str:
    """Standard input as text (nothing when it is closed), bounded like a file."""
    import sys

    return read_bounded(sys.stdin.buffer, "standard input", advice) if sys.stdin is not None else ""


def require_stdout() -> None:
    """Commands whose product is stdout refuse a closed one (`>&-`) before any work, not after loading a model."""
    import sys

    if sys.stdout is None:
        raise InputError("standard output is closed (>&-): redirect it to a file, or to /dev/null to discard it")


def checkpoint_given(argument: Path | None, option: Path | None) -> Path:
    """The checkpoint a command takes as its argument or as -m/-c (quantize, export, run, tokenize): a path or a
    store name (none: the default model), checked to be a file before anything heavy is imported."""
    from ...models import checkpoint_file, resolve_checkpoint

    if argument is not None and option is not None:
        import typer

        raise typer.BadParameter("give the checkpoint once: as the argument or as -m, not both", param_hint="'-m'")
    from ..render import activity, stderr_console

    with activity(stderr_console()) as show:
        path = checkpoint_file(resolve_checkpoint(argument if argument is not None else option), show)
    if not path.is_file():
        raise InputError(f"no checkpoint {path}: no such file (`manas list` shows the models in the store)")
    return path


def load_model(options: ModelOptions, console=None):
    """models.open_model, saying on `console` (if given) what there is to say about the engine: (checkpoint, threads,
    engine)."""
    from ..render import activity

    with activity(console) as show:
        loaded = open_model(options, show)
    if console is not None:
        report_engine(console, loaded.opened, options.debug)
        if loaded.window_notice:
            from ..render import say

            say(console, loaded.window_notice)
    return loaded.checkpoint, loaded.threads, loaded.engine


def report_engine(console, opened, debug: bool) -> None:
    """One line when this run compiled the core (once per source, compiler and CPU), one when native was asked
    for and torch runs instead; with --debug, the compiler's own message."""
    from ..render import say

    if opened.compile_s is not None:
        say(console, f"compiled the native core in {opened.compile_s:.1f} s (once: cached as {opened.library})")
    if opened.notice:
        say(console, opened.notice)
    if debug and opened.detail:
        console.print(opened.detail.rstrip(), markup=False, highlight=False)


def check_memory(engine, rows: int, positions: int, lower: str) -> None:
    """Refuse a run the device cannot hold before allocating it (see memory.check_fits)."""
    from ...engine.memory import check_fits

    check_fits(engine, rows, positions, lower)


def read_prompt(prompt: str | None, prompt_file: Path | None, default: str | None = None) -> str:
    """--prompt TEXT, --prompt-file PATH, '-' or nothing for standard input (or `default`, where one is given)."""
    import sys

    if prompt is not None and prompt_file is not None:
        import typer

        # A usage error (exit 2), like any other misuse of the flags.
        raise typer.BadParameter("give either --prompt or --prompt-file, not both", param_hint="'--prompt-file'")
    advice = "only the prompt's end reaches the model: pass that (tail -c 1000000 FILE | manas generate)"
    if prompt_file is not None:
        try:
            with prompt_file.open("rb") as f:
                return read_bounded(f, f"prompt file {prompt_file}", advice)
        except OSError as exc:
            raise InputError(f"cannot read prompt file {prompt_file}: {exc.strerror}") from None
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and default is not None:
        return default
    if sys.stdin is not None and sys.stdin.isatty():
        print("reading the prompt from standard input (end it with Ctrl-D)", file=sys.stderr)
    return read_stdin(advice)


def chat_template_text(path: Path | None) -> str | None:
    """--chat-template FILE's template, checked to parse."""
    from ...chat import check_template

    if path is None:
        return None
    template = read_text_file(path, "chat template", "a chat template is a few kilobytes of Jinja")
    check_template(template)
    return template


def model_chat_template(checkpoint) -> str | None:
    """The template the checkpoint stores (converted from its folder's), checked to parse; None for a base model."""
    from ...chat import check_template

    template = (checkpoint.metadata or {}).get("chat_template")
    if template is not None:
        check_template(template)
    return template


def speculation(
    lookup: int | None,
    draft_model: Path | None,
    draft_max: int,
    options: ModelOptions,
    checkpoint,
    engine,
    samples: int = 1,
):
    """--lookup N or --draft-model M (with --draft-max K), checked: (the draft model's engine or None, the
    settings.Speculation every request runs unless it says otherwise, or None without either flag). Speculation runs
    where a session checks several tokens in one pass with each step's bits (the native engine's), for one sample."""
    from ...models import open_draft
    from ...settings import Speculation

    if not lookup and draft_model is None:
        return None, None
    flag = "--lookup" if lookup else "--draft-model"
    if lookup and draft_model is not None:
        raise InputError("--lookup and --draft-model are two ways to propose tokens: choose one")
    if not hasattr(engine.new_session(), "check"):
        raise InputError(f"{flag} runs on the native engine, whose checks give each step's bits (--engine native)")
    if samples != 1:
        raise InputError(f"{flag} decodes one sample: drop --num-samples (or --batch)")
    block_size = checkpoint.model.config.block_size
    if (lookup or 0) >= block_size:
        raise InputError(f"--lookup takes an n-gram of 1 to {block_size - 1} tokens (the window), got {lookup}")
    if lookup:
        return None, Speculation(lookup=lookup, draft_max=draft_max)
    draft = open_draft(options, draft_model, checkpoint.encoding).engine
    return draft, Speculation(draft=True, draft_max=draft_max)
