"""`manas chat`: a conversation in the terminal, or one message per line from a pipe (conversation.py keeps the
cache between turns; this module reads, prints and handles the keys)."""

import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...errors import InputError
from ...settings import GenerationSettings
from ..flags import (
    STRUCTURED_FLAGS,
    DraftMaxOption,
    DraftMinOption,
    DraftModelOption,
    LookupOption,
    checked_setting,
    format_of,
    takes_flags,
    takes_model_flags,
)

if TYPE_CHECKING:
    from ...models import ModelOptions


HELP = "/help lists the commands · Up recalls a message · Ctrl-C stops an answer · Ctrl-D or /bye ends"
COMMANDS = """/help                    this list
/set temperature 0.2     a setting for the answers to come: temperature, top_p, top_k, min_p, seed, max_tokens,
                         repetition_penalty, presence_penalty, frequency_penalty (ollama's num_predict and
                         repeat_penalty too; /set parameter NAME VALUE as in ollama); /set NAME none unsets one
/set system TEXT         the system prompt (the conversation starts again); /system TEXT as well
/clear, /reset           forget the conversation
/bye, /exit              end the chat (Ctrl-D too)
Up and Down recall earlier messages (kept per model); a line ending in \\ continues on the next; a line of three
quotes opens and closes a block; Ctrl-C stops an answer, and at the prompt clears it."""
# ollama's /set parameter names, as manas names those settings
SETTING_ALIASES = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}
SETTABLE = (
    "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "repetition_penalty", "repeat_last_n",
    "presence_penalty", "frequency_penalty",
)  # fmt: skip
CONTINUE = "\\"  # a line ending so continues on the next
BLOCK = '"""'  # a line of three quotes opens and closes a multi-line message, as in ollama
HISTORY_LINES = 1000


def run(
    *,
    system: str | None,
    chat_template: Path | None,
    settings: GenerationSettings,
    stats: bool | None,
    json_output: bool,
    model_options: "ModelOptions",
    given: list[str] | None = None,
    think: bool | None = None,
    lookup: int | None = None,
    draft_model: Path | None = None,
    draft_max: int = 4,
    draft_min: int = 0,
) -> None:
    """The conversation at the terminal, or one message a line from a pipe; `given`: these messages alone (manas
    run NAME PROMPT); `think`: the template's enable_thinking (None: its default)."""
    from ...conversation import Conversation
    from ...models import model_name
    from ...records import json_line
    from ..render import say, stderr_console
    from .common import chat_template_text, load_model, model_chat_template, require_stdout, speculation

    require_stdout()
    console = stderr_console()
    interactive = given is None and sys.stdin is not None and sys.stdin.isatty()
    show_stats = stats if stats is not None else interactive
    template = chat_template_text(chat_template)
    checkpoint, _, engine = load_model(model_options, console)
    template = template or model_chat_template(checkpoint)
    if template is None:
        raise InputError(
            f"{checkpoint.path.name} has no chat template (a base model): give one with --chat-template FILE, or "
            "use manas generate to continue a text"
        )
    kwargs = None if think is None else {"enable_thinking": think}
    draft, speculative = speculation(lookup, draft_model, draft_max, model_options, checkpoint, engine)
    conversation = Conversation(
        engine, checkpoint.encoding, template, system, template_kwargs=kwargs, draft=draft, speculative=speculative,
        draft_min=draft_min,
    )  # fmt: skip
    if interactive:
        say(console, f"chatting with {checkpoint.path.stem} · {HELP}")
    with history(model_name(model_options.checkpoint) if interactive else None):
        for message in given if given is not None else messages(interactive):
            if message.startswith("/"):
                settings = chat_command(message, conversation, settings, lambda text: say(console, text))
            elif json_output:
                answer = conversation.reply(message, settings, lambda text: None, lambda: False)
                print(json_line(answer_record(answer, engine)))
                sys.stdout.flush()
            else:
                answer = answer_one(conversation, message, settings)
                if show_stats:
                    say(console, stats_line(answer))


def chat_command(message: str, conversation, settings: GenerationSettings, tell) -> GenerationSettings:
    """A /command typed in the chat (COMMANDS): done, told to `tell`; the settings for the answers to come."""
    name, _, rest = message.partition(" ")
    rest = rest.strip()
    if name in ("/reset", "/clear"):
        conversation.reset()
        tell("the conversation is forgotten")
    elif name == "/system" or (name == "/set" and rest.split(" ", 1)[0] == "system"):
        conversation.system = (rest.removeprefix("system").strip() if name == "/set" else rest) or None
        conversation.reset()
        tell("system prompt set; the conversation starts again")
    elif name == "/set":
        return _set(rest.removeprefix("parameter ").strip(), settings, tell)
    elif name == "/help":
        tell(COMMANDS)
    else:
        tell(f"unknown command {name}: {HELP}")
    return settings


def _set(assignment: str, settings: GenerationSettings, tell) -> GenerationSettings:
    """`/set NAME VALUE`: settings with that one changed, under the rule generate's flag obeys (settings.RULES)."""
    from dataclasses import replace

    from ...settings import check

    given, _, text = assignment.partition(" ")
    name = SETTING_ALIASES.get(given, given)
    if name not in SETTABLE or not text.strip():
        tell(f"/set takes a setting and its value (/set temperature 0.2): one of {', '.join(SETTABLE)}")
        return settings
    try:
        value = None if text.strip() == "none" else json.loads(text)
    except ValueError:
        tell(f"{name} not set: {text.strip()!r} is not a number")
        return settings
    try:
        settings = replace(settings, **{name: check(name, value)})
    except ValueError as exc:  # out of the setting's range: the rule, as generate's flag states it
        tell(f"{name} not set: {exc}")
        return settings
    tell(f"{name} is {getattr(settings, name)}")
    return settings


def answer_one(conversation, message: str, settings: GenerationSettings):
    """One answer streamed to stdout; Ctrl-C (SIGINT) stops it and keeps the conversation."""
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        answer = conversation.reply(message, settings, _write, lambda: bool(interrupted))
    finally:
        signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return answer


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def stats_line(answer) -> str:
    stats = answer.stats
    new = stats.prompt_tokens - answer.reused
    cut = " · stopped" if answer.finish_reason == "interrupted" else ""
    return (
        f"{stats.generated_tokens} tokens · {stats.decode_tokens_per_s:.1f} tok/s · first token "
        f"{stats.ttft_s * 1000:.0f} ms · prefilled {new} of {stats.prompt_tokens} prompt tokens "
        f"({answer.reused} cached){cut}"
    )


def answer_record(answer, engine) -> dict:
    """--json: one object a line per answer; what reproduces it as generate's records say it (the seed, the
    engine and, on the native one, the core's arithmetic version)."""
    stats = answer.stats
    return {
        "text": answer.text,
        "reasoning_content": answer.thought,
        "tokens": answer.tokens,
        "finish_reason": answer.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "reused_tokens": answer.reused,
        "generated_tokens": stats.generated_tokens,
        "ttft_s": stats.ttft_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "seed": answer.seed,
        "engine": engine.name,
        "arithmetic_version": engine.arithmetic_version,
        **(
            {"proposed_tokens": stats.proposed_tokens, "accepted_tokens": stats.accepted_tokens} if stats.checks else {}
        ),
    }


def messages(interactive: bool) -> Iterator[str]:
    """The user's messages: from a pipe one a line; at a terminal a line, a line continued by a final backslash,
    or a block between two lines of three quotes. Ctrl-C at the prompt clears it; Ctrl-D (or /bye, /exit) ends."""
    if not interactive:
        for line in sys.stdin if sys.stdin is not None else ():
            if line.strip():
                yield line.rstrip("\n")
        return
    while True:
        try:
            message = _read_message()
        except KeyboardInterrupt:
            sys.stderr.write("\n")
            continue
        except EOFError:
            sys.stderr.write("\n")
            return
        if message.strip() in ("/bye", "/exit"):
            return
        if message.strip():
            yield message.strip()


@contextmanager
def history(name: str | None) -> Iterator[None]:
    """Line editing (readline's: arrows, Ctrl-A/E, Ctrl-R) and the model's earlier messages, read from
    $MANAS_HOME/history/NAME and written back there at the end, the file the user's alone (0600); None: none kept
    (a pipe, one message)."""
    if name is None:
        yield
        return
    try:
        import readline
    except ImportError:  # a Python built without it: input() still reads a line, without editing
        yield
        return
    from ... import store

    path = store.home() / "history" / re.sub(r"[^\w.-]", "-", name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    readline.clear_history()
    readline.set_history_length(HISTORY_LINES)
    try:
        readline.read_history_file(path)
    except OSError:  # none yet, or unreadable: this chat starts one
        pass
    try:
        yield
    finally:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            os.chmod(path, 0o600)
            readline.write_history_file(path)
        except OSError:  # a read-only home: the chat happened, its history is not kept
            pass


def _read_message() -> str:
    line = input(">>> ")
    if line.strip() == BLOCK:
        lines = []
        while (line := input("... ")).strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)
    lines = [line]
    while lines[-1].endswith(CONTINUE):
        lines[-1] = lines[-1][: -len(CONTINUE)]
        lines.append(input("... "))
    return "\n".join(lines)


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags(cache=False)
@takes_flags(STRUCTURED_FLAGS, format_of, "answer_format")
def command(
    system: Annotated[
        Optional[str], typer.Option(help="The system prompt (the template's default without it).")
    ] = None,
    chat_template: Annotated[
        Optional[Path], typer.Option(help="A Jinja chat template for a model without one.")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="The most tokens of one answer.")] = 512,
    temperature: Annotated[
        float,
        typer.Option("--temperature", "-t", "--temp", callback=checked_setting("temperature"), help="0 is greedy."),
    ] = GenerationSettings.temperature,
    top_p: Annotated[Optional[float], typer.Option(callback=checked_setting("top_p"), help="Nucleus sampling.")] = None,
    top_k: Annotated[Optional[int], typer.Option(min=1, help="Sample among the k most likely.")] = None,
    seed: Annotated[
        Optional[int],
        typer.Option("--seed", "-s", callback=checked_setting("seed"), help="Seed each answer's sampler."),
    ] = None,
    stats: Annotated[
        Optional[bool],
        typer.Option(
            "--stats/--no-stats", help="A line of speed and cache figures under each answer. Default: on a terminal."
        ),
    ] = None,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object a line per answer: text, reasoning_content (a thinking model's thought), tokens, "
            "finish_reason, token counts, seed, engine.",
        ),
    ] = False,
    think: Annotated[
        Optional[bool],
        typer.Option(
            "--think/--no-think",
            help="For a model that thinks before it answers (Qwen3, SmolLM3): the template's enable_thinking. "
            "Default: the template's own (they think).",
        ),
    ] = None,
    lookup: LookupOption = None,
    draft_model: DraftModelOption = None,
    draft_max: DraftMaxOption = 4,
    draft_min: DraftMinOption = 0,
    *,
    answer_format: object,
    model_options: "ModelOptions",
) -> None:
    r"""Chat with an instruct model in the terminal, or send it one message per line from a pipe.

    The messages go through the model's chat template (or --chat-template FILE); the conversation's KV cache is
    kept between turns, so each turn prefills only what it adds (the native engine), and every answer is what
    manas generate gives the whole rendered prompt. At the prompt: a line ending in a backslash continues, three
    quotes open and close a block; Up and Down recall earlier messages (kept per model); /help lists the commands:
    /set temperature 0.2 (and the other settings), /system TEXT, /clear; Ctrl-C stops an answer, Ctrl-D (or /bye,
    /exit) ends. A thinking model (Qwen3, SmolLM3) writes its thought between <think> and </think> before its
    answer; --no-think asks it not to, and a structured output (--json-schema) constrains the answer after it.

    Examples:

      manas chat -m smollm2-135m-instruct

      printf 'Hello!\nWhat did I just say?\n' | manas chat -m qwen2.5-0.5b-instruct -t 0

      manas chat -m qwen3-0.6b --no-think
    """

    settings = GenerationSettings(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=(),
        format=answer_format,
    )
    run(
        system=system,
        chat_template=chat_template,
        settings=settings,
        stats=stats,
        json_output=json_output,
        model_options=model_options,
        think=think,
        lookup=lookup,
        draft_model=draft_model,
        draft_max=draft_max,
        draft_min=draft_min,
    )
