"""Chat: the messages of a conversation as the prompt text a model was tuned on, through the Jinja chat template its
folder declares, rendered as transformers renders it (jinja2's immutable sandbox, trim_blocks and lstrip_blocks).

A template is code from a file: it renders in a worker process whose time and memory the operating system bounds
(template_worker), behind cheap checks of its size and of every value it builds (chat_template), so that one that
loops forever, builds a gigabyte or raises is one error, never a hang, an exhausted machine or a traceback. jinja2
is an optional extra (`pip install "manas-cli[chat]"`)."""

from __future__ import annotations

from dataclasses import dataclass

from .chat_template import check_size
from .template_worker import worker

MAX_MESSAGES = 1024
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def parse_messages(value: object) -> list[Message]:
    """OpenAI's `messages`: a non-empty list of {"role": system|user|assistant, "content": string or text parts};
    ValueError names the first entry that is not."""
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages")
    messages = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or entry.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with a role ({', '.join(ROLES)}) and a content")
        if unknown := sorted(set(entry) - {"role", "content", "name"}):
            raise ValueError(f"messages[{i}] has {unknown[0]!r}, which manas does not take (role, content, name)")
        messages.append(Message(entry["role"], _content(entry.get("content"), i)))
    return messages


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


def render(template: str, messages: list[Message], *, bos_token: str = "", eos_token: str = "") -> str:
    """The prompt for the assistant's next turn: the template over the messages with add_generation_prompt, rendered
    in the template worker (bounded by the operating system, see template_worker)."""
    check_size(template)
    as_dicts = [{"role": m.role, "content": m.content} for m in messages]
    return worker().render(template, as_dicts, bos_token, eos_token)


def check_template(template: str) -> None:
    """Refuse, naming why, a template that does not parse or is too large (before it is stored or served). It is
    compiled in the worker: jinja2 runs a template's constant expressions while compiling."""
    check_size(template)
    worker().compile(template)


def prompt_ids(template: str, messages: list[Message], encoding) -> list[int]:
    """The token ids the model's next turn follows: the rendered template, its special tokens as themselves (as
    transformers' apply_chat_template tokenizes it: the template writes any BOS itself)."""
    from .formats.tokenizer import END_OF_TEXT, encode_text

    bos = getattr(encoding, "bos", None) or ""
    eos = getattr(encoding, "end_of_text", END_OF_TEXT)
    return encode_text(encoding, render(template, messages, bos_token=bos, eos_token=eos), special=True)
