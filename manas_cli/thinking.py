"""Models that think before they answer (Qwen3, SmolLM3, DeepSeek-R1's distillations): their answer opens with a
thought between <think> and </think>. This module tells, from the rendered prompt, where the answer starts (inside a
thought the prompt opened, free to open one, or past any), splits the answer's text into its thought and the reply
after it as the text streams (as vLLM's and llama-server's reasoning parsers return reasoning_content), and puts a
structured output's grammar after the thought, so that only the reply is constrained.

A template thinks if it writes </think> (each of these families' does: it closes an empty thought when thinking is
off, or strips earlier turns' thoughts). Text is split on the tags as text: a vocabulary's <think> token decodes to
them too."""

from __future__ import annotations

import json
import re

from .structured import Format

OPEN, CLOSE = "<think>", "</think>"
# Where an answer starts: inside a thought the prompt opened (Qwen3-Thinking's template ends with <think>), free to
# open one, or with no thought to come (not a thinking template, or one whose prompt closed an empty thought).
INSIDE, MAY_OPEN, NONE = "inside", "may_open", "none"


def thinks(template: str) -> bool:
    """Whether the chat template is one of a model that thinks."""
    return CLOSE in template


def start_state(template: str, prompt: str) -> str:
    """Where the answer to this rendered prompt starts: INSIDE, MAY_OPEN or NONE."""
    if not thinks(template):
        return NONE
    opened, closed = prompt.rfind(OPEN), prompt.rfind(CLOSE)
    if opened > closed:
        return INSIDE
    if closed >= 0 and not prompt[closed + len(CLOSE) :].strip():  # thinking off: the prompt closed an empty one
        return NONE
    return MAY_OPEN


GAP, REPLY = "gap", "reply"  # the splitter's states past a thought: the whitespace after </think>, then the reply


class ThoughtSplitter:
    """An answer's text, fed as it streams, split into its thought (the text between the tags, trimmed) and its
    reply (the text after </think>, its leading whitespace dropped). Text that may still be part of a tag, and
    whitespace that may still end the thought, is held until it is known."""

    def __init__(self, state: str) -> None:
        self.state = REPLY if state == NONE else state
        self.held = ""
        self.thought = state == INSIDE  # whether the answer has a thought
        self._thought_begun = False  # a thought's leading whitespace is dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(thought, reply) text this piece releases."""
        self.held += text
        thought = reply = ""
        while True:
            if self.state == MAY_OPEN:
                opening = self.held.lstrip()
                if opening.startswith(OPEN):
                    self.state, self.held, self.thought = INSIDE, opening[len(OPEN) :], True
                elif OPEN.startswith(opening):  # whitespace so far, or the tag begun
                    return thought, reply
                else:
                    self.state = REPLY
            elif self.state == INSIDE:
                end = self.held.find(CLOSE)
                if end < 0:
                    cut = len(self.held[: len(self.held) - _partial_tag(self.held, CLOSE)].rstrip())
                    thought += self._thought(self.held[:cut])
                    self.held = self.held[cut:]
                    return thought, reply
                thought += self._thought(self.held[:end].rstrip())
                self.state, self.held = GAP, self.held[end + len(CLOSE) :]
            elif self.state == GAP:
                self.held = self.held.lstrip()
                if not self.held:
                    return thought, reply
                self.state = REPLY
            else:
                reply, self.held = reply + self.held, ""
                return thought, reply

    def finish(self) -> tuple[str, str]:
        """What is still held when the answer ends: a thought cut short ends there; a tag begun is the reply's."""
        held, self.held = self.held, ""
        if self.state == INSIDE:
            return self._thought(held.rstrip()), ""
        return "", held if self.state == MAY_OPEN else ""

    def _thought(self, text: str) -> str:
        if not self._thought_begun:
            text = text.lstrip()
            self._thought_begun = bool(text)
        return text


def split(text: str, state: str) -> tuple[str | None, str]:
    """A whole answer's (thought, reply): thought None where the answer has none."""
    splitter = ThoughtSplitter(state)
    thought, reply = splitter.feed(text)
    rest_thought, rest_reply = splitter.finish()
    return (thought + rest_thought if splitter.thought else None), reply + rest_reply


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def after_thought(format: Format, state: str, special_tokens: set[str]) -> Format:
    """The grammar of a reply in `format` after the thought the answer may (MAY_OPEN) or must (INSIDE) think first:
    Lark whose start is the thought, then the format's own start. A JSON Schema becomes Lark's %json; a Lark grammar
    of manas' own (tool calls) has its start renamed."""
    if state == NONE:
        return format
    if format.kind == "json_schema":
        answer = f"answer: %json {format.text}"
    elif format.kind == "lark":
        answer = re.sub(r"^start:", "answer:", format.text, count=1, flags=re.MULTILINE)
    else:
        raise ValueError(f"a {format.describe()} cannot follow a thought")
    if CLOSE in special_tokens:  # a text lexeme never holds a special token: the thought ends at it
        thought = [f"thought: THOUGHT {CLOSE}", "THOUGHT: /(?s:.*)/"]
    else:  # ended by the first </think> in its text
        thought = [f"thought[suffix={json.dumps(CLOSE)}]: /(?s:.*)/"]
    opening = OPEN if OPEN in special_tokens else json.dumps(OPEN)
    start = "start: thought GAP answer" if state == INSIDE else f"start: ({opening} thought)? GAP answer"
    lines = [start, answer, *thought, r"GAP: /[ \t\n]*/"]
    return Format("lark", "\n".join(lines) + "\n")
