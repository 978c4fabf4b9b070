"""Chat: the messages of a conversation as the prompt text a model was tuned on, through the Jinja chat template its
folder declares, rendered as transformers renders it (jinja2's immutable sandbox, trim_blocks and lstrip_blocks).

A template is code from a file: it renders in a worker process whose time and memory the operating system bounds
(template_worker), behind cheap checks of its size and of every value it builds (chat_template), so that one that
loops forever, builds a gigabyte or raises is one error, never a hang, an exhausted machine or a traceback. jinja2
is an optional extra (`pip install "manas-cli[chat]"`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .chat_template import RESERVED, check_size
from .template_worker import worker

MAX_MESSAGES = 1024
ROLES = ("system", "user", "assistant", "tool")
MAX_TEMPLATE_KWARGS = 32  # enable_thinking, and the few switches templates read


@dataclass(frozen=True)
class Prompt:
    """A rendered chat prompt: its ids, and where its answer starts with respect to a thought (thinking.py)."""

    ids: list[int]
    thought: str  # thinking.INSIDE, MAY_OPEN or NONE
    thinks: bool  # whether the template is a thinking model's (its answers are split into thought and reply)


@dataclass(frozen=True)
class Message:
    role: str
    content: str | None  # None: an assistant's message that only calls tools
    tool_calls: tuple[dict, ...] = ()  # an assistant's calls: {"id", "type": "function", "function": {...}}
    tool_call_id: str | None = None  # a tool's message: the call it answers

    def as_template_reads(self) -> dict:
        """The message as transformers hands it to a template: a call's arguments as the object they encode (as
        vLLM passes them: templates write them with tojson), keys only where the message has them (Llama 3.x's
        template asks whether 'tool_calls' is in a message)."""
        message = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [_call_as_template_reads(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _call_as_template_reads(call: dict) -> dict:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:  # not JSON: the text as it is
        arguments = function["arguments"]
    return {**call, "function": {**function, "arguments": arguments}}


def parse_messages(value: object) -> list[Message]:
    """OpenAI's `messages`: a non-empty list of {"role": system|user|assistant|tool, "content": string or text
    parts}, an assistant's with its `tool_calls`, a tool's with its `tool_call_id`; ValueError names the first
    entry that is not."""
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages")
    return [_message(entry, i) for i, entry in enumerate(value)]


def _message(entry: object, i: int) -> Message:
    if not isinstance(entry, dict) or entry.get("role") not in ROLES:
        raise ValueError(f"messages[{i}] must be an object with a role ({', '.join(ROLES)}) and a content")
    taken = {"role", "content", "name"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(
        entry["role"], set()
    )
    if unknown := sorted(set(entry) - taken):
        raise ValueError(f"messages[{i}] has {unknown[0]!r}, which manas does not take ({', '.join(sorted(taken))})")
    calls = _tool_calls(entry.get("tool_calls"), i)
    if entry["role"] == "tool" and not isinstance(entry.get("tool_call_id"), str):
        raise ValueError(f"messages[{i}] is a tool's answer: it needs the tool_call_id of the call it answers")
    content = None if calls and entry.get("content") is None else _content(entry.get("content"), i)
    return Message(entry["role"], content, calls, entry.get("tool_call_id"))


def _tool_calls(calls: object, i: int) -> tuple[dict, ...]:
    """An assistant message's tool_calls, as OpenAI writes them: arguments a JSON string."""
    if calls is None:
        return ()
    shape = (
        f'messages[{i}].tool_calls must be a list of {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
    )
    if not isinstance(calls, list):
        raise ValueError(shape)
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not all(isinstance(function.get(k), str) for k in ("name", "arguments")):
            raise ValueError(shape)
        if not isinstance(call.get("id", ""), str) or call.get("type", "function") != "function":
            raise ValueError(shape)
    return tuple(calls)


def _content(content: object, i: int) -> str:
    """A message's content: a string, or OpenAI's content parts, of which manas takes text ones, joined by newlines
    (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"messages[{i}].content must be a string or a non-empty list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise ValueError(
                f'messages[{i}].content[{j}] must be a text part ({{"type": "text", "text": ...}})'
                + (f": manas takes no {kind!r} parts" if isinstance(kind, str) and kind != "text" else "")
            )
        texts.append(part["text"])
    return "\n".join(texts)


def check_template_kwargs(value: object) -> dict | None:
    """vLLM's chat_template_kwargs: an object of variables for the template (enable_thinking), none of the names the
    renderer sets itself; ValueError says which is not."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            'chat_template_kwargs must be an object of template variables, e.g. {"enable_thinking": false}'
        )
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs holds {len(value)} variables: at most {MAX_TEMPLATE_KWARGS}")
    for name in value:
        if not name.isidentifier():
            raise ValueError(f"chat_template_kwargs' {name[:40]!r} is not a template variable's name")
        if name in RESERVED:
            raise ValueError(f"chat_template_kwargs may not set {name!r}: the request gives it")
    return value


def render(
    template: str,
    messages: list[Message],
    *,
    bos_token: str = "",
    eos_token: str = "",
    tools: list | None = None,
    kwargs: dict | None = None,
) -> str:
    """The prompt for the assistant's next turn: the template over the messages (and the tools the model may call,
    and the template variables kwargs sets) with add_generation_prompt, rendered in the template worker (bounded by
    the operating system, see template_worker)."""
    check_size(template)
    as_dicts = [message.as_template_reads() for message in messages]
    return worker().render(template, as_dicts, bos_token, eos_token, tools, kwargs)


def check_template(template: str) -> None:
    """Refuse, naming why, a template that does not parse or is too large (before it is stored or served). It is
    compiled in the worker: jinja2 runs a template's constant expressions while compiling."""
    check_size(template)
    worker().compile(template)


def render_prompt(
    template: str, messages: list[Message], encoding, tools: list | None = None, kwargs: dict | None = None
) -> Prompt:
    """The token ids the model's next turn follows: the rendered template, its special tokens as themselves (as
    transformers' apply_chat_template tokenizes it: the template writes any BOS itself); and whether its answer
    starts inside a thought, may open one, or has none (thinking.start_state)."""
    from . import thinking
    from .formats.tokenizer import END_OF_TEXT, encode_text

    bos = getattr(encoding, "bos", None) or ""
    eos = getattr(encoding, "end_of_text", END_OF_TEXT)
    text = render(template, messages, bos_token=bos, eos_token=eos, tools=tools, kwargs=kwargs)
    ids = encode_text(encoding, text, special=True)
    return Prompt(ids, thinking.start_state(template, text), thinking.thinks(template))
