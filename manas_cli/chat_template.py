"""A chat template rendered in this process, as transformers renders it (jinja2's immutable sandbox, trim_blocks and
lstrip_blocks), with the cheap checks that turn the usual hostile template into a clear error at once: its size,
every string and list it builds, the work it does (template lines run), every *, ** and + before it runs.

These checks are the fast path, not the bound: jinja2 folds constant expressions while compiling, and one step
(a filter, an integer power) can cost minutes or gigabytes. The bound is the operating system's, enforced on the
worker process that runs this module (manas_cli.template_worker)."""

from __future__ import annotations

import functools
import json
import sys
import time

from .errors import InputError, MissingDependencyError, first_line

MAX_TEMPLATE_CHARS = 64 * 1024  # real templates are 1–10 KB (Qwen2.5's 2.5 KB, Llama 3.1's 9 KB)
MAX_VALUE_CHARS = 1 << 20  # the longest string or list a template may build, its output included
MAX_STEPS = 200_000  # template lines run: 40 messages through Qwen2.5's template run 257


class TemplateError(InputError):
    """A chat template that cannot render these messages: it does not parse, raises, or runs past its bounds."""


# What the renderer itself sets: a request's chat_template_kwargs may not replace them
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def render(
    template: str,
    messages: list[dict],
    *,
    bos_token: str = "",
    eos_token: str = "",
    tools: list | None = None,
    kwargs: dict | None = None,
) -> str:
    """The prompt for the assistant's next turn: the template over the messages with add_generation_prompt, and
    `tools` (None without: transformers always passes the name, and Llama 3.x's template asks whether it is
    defined); `kwargs`: more variables for the template, as apply_chat_template passes its keyword arguments
    (enable_thinking)."""
    compiled = _compile(template)
    context = {
        **(kwargs or {}),
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": True,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    pieces, size = [], 0
    with _bounded_steps():
        try:
            for piece in compiled.generate(**context):
                size += len(piece)
                if size > MAX_VALUE_CHARS:
                    raise TemplateError(f"the chat template's output is over {MAX_VALUE_CHARS:,} characters")
                pieces.append(piece)
        except (TemplateError, MemoryError):  # MemoryError: the worker's limit, which it names
            raise
        except RecursionError:
            raise TemplateError("the chat template recursed too deeply") from None
        except Exception as exc:  # whatever the template raises (raise_exception, a type error, the sandbox's own)
            raise TemplateError(f"the chat template failed: {first_line(exc)}") from None
    return "".join(pieces)


def check_template(template: str) -> None:
    """Refuse, naming why, a template that does not parse or is too large (before it is stored or served)."""
    _compile(template)


def check_size(template: str) -> None:
    """Refuse an empty template, or one larger than any real one (checked by the caller too, before the worker)."""
    if not isinstance(template, str) or not template.strip():
        raise TemplateError("the chat template is empty")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"the chat template is over {MAX_TEMPLATE_CHARS:,} characters")


@functools.lru_cache(maxsize=8)  # a server renders its one template per request
def _compile(template: str):
    check_size(template)
    environment = _environment()
    try:
        return environment.from_string(template)
    except MemoryError:  # a constant folded while compiling, past the worker's limit
        raise
    except Exception as exc:  # TemplateSyntaxError, and whatever else a hostile template makes the parser raise
        raise TemplateError(f"the chat template does not parse: {first_line(exc)}") from None


def require_jinja2() -> None:
    """MissingDependencyError, saying how to install it, where jinja2 is not installed."""
    import importlib.util

    if importlib.util.find_spec("jinja2") is None:
        raise MissingDependencyError(
            'chat templates need jinja2: pip install "manas-cli[chat]" (from a clone: pip install -e ".[chat]")'
        )


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with every *, ** and + checked before it runs, and every call's result bounded."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateError("the chat template raises a number to a power over 64")
            if operator == "*" and _length(left) * _count(right) + _length(right) * _count(left) > MAX_VALUE_CHARS:
                raise TemplateError(f"the chat template builds a value over {MAX_VALUE_CHARS:,} long")
            if operator == "+" and _length(left) + _length(right) > MAX_VALUE_CHARS:
                raise TemplateError(f"the chat template builds a value over {MAX_VALUE_CHARS:,} long")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            if any(
                isinstance(a, int) and not isinstance(a, bool) and a > MAX_VALUE_CHARS
                for a in (*args, *kwargs.values())
            ):
                raise TemplateError(f"the chat template passes a number over {MAX_VALUE_CHARS:,} to a call")
            result = super().call(__context, __obj, *args, **kwargs)
            if _length(result) > MAX_VALUE_CHARS:
                raise TemplateError(f"the chat template builds a value over {MAX_VALUE_CHARS:,} long")
            return result

    environment = Bounded(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: time.strftime(format)
    # transformers' tojson: plain JSON (jinja2's own escapes <, > and & for HTML)
    environment.filters["tojson"] = lambda value, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys
    )
    return environment


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the messages: {message}")


def _length(value: object) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _bounded_steps:
    """Counts the lines of template code run in this thread (jinja2 compiles a template to Python whose code is
    named <template>), and stops the template past MAX_STEPS: a loop that outputs nothing never yields, so only a
    trace sees it. Other code runs untraced."""

    def __enter__(self) -> None:
        self.steps, self.previous = 0, sys.gettrace()
        sys.settrace(self._call)

    def __exit__(self, *exc) -> None:
        sys.settrace(self.previous)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise TemplateError(f"the chat template ran over {MAX_STEPS:,} steps: it loops too long")
        return self._line
