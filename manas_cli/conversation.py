"""A conversation with an instruct model: its messages, and the KV cache that keeps them between turns, so that a
turn prefills only the tokens its rendering adds after what the cache already holds (on the native engine; torch
prefills the whole again). Each turn's answer is what `manas generate` gives the rendered prompt alone: the cache
keeps only the positions whose tokens are the prompt's own, and extending a prefill gives a whole prefill's bits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import thinking
from .chat import Message, Prompt, render_prompt
from .engine.engines import Engine
from .engine.generation import GenerationStats
from .engine.prefix_cache import common_start
from .requests import Requests
from .settings import GenerationSettings, Speculation


@dataclass
class Answer:
    text: str
    finish_reason: str  # "length", "stop", "end_of_text", or "interrupted"
    stats: GenerationStats
    reused: int  # prompt tokens the cache already held
    tokens: list[int]  # the answer's token ids
    seed: int  # what reproduces it: the same seed, settings and conversation
    thought: str | None = None  # a thinking model's thought (thinking.py), also in `text`; None: it had none


@dataclass
class Conversation:
    engine: Engine
    encoding: object
    template: str
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    template_kwargs: dict | None = None  # variables for the template: {"enable_thinking": False} (chat --no-think)
    draft: Engine | None = None  # speculative decoding's draft model (chat --draft-model)
    speculative: Speculation | None = None  # every answer's speculative decoding (chat --lookup, --draft-model)
    draft_min: int = 0  # the fewest tokens a check proposes (chat --draft-min)

    def __post_init__(self) -> None:
        self.requests = Requests(self.engine, self.encoding, self.draft, self.speculative)
        self.session = self.engine.new_session()
        self.cached: list[int] = []  # the tokens at the cache's positions 0 .. len − 1

    def reset(self) -> None:
        """Forget the messages (the system prompt stays)."""
        self.messages, self.cached = [], []
        self.session.reset()

    def prompt(self, user: str) -> Prompt:
        """What the next answer follows: the whole conversation rendered, its ids cropped to the window."""
        system = [Message("system", self.system)] if self.system else []
        messages = [*system, *self.messages, Message("user", user)]
        prompt = render_prompt(self.template, messages, self.encoding, kwargs=self.template_kwargs)
        return replace(prompt, ids=prompt.ids[-self.engine.config.block_size :])

    def reply(
        self, user: str, settings: GenerationSettings, on_text: Callable[[str], None], stopped: Callable[[], bool]
    ) -> Answer:
        """The assistant's answer to `user`, its text handed to on_text as it comes; stopped() ends it early (the
        answer so far is kept). The user's message and the answer join the conversation."""
        prompt = self.prompt(user)
        ids = prompt.ids
        reused = self._reusable(ids)
        if prompt.thinks and settings.format is not None and settings.format.kind == "json_schema":
            # the schema constrains the reply, after the thought
            special = self.encoding.special_tokens_set
            settings = replace(settings, format=thinking.after_thought(settings.format, prompt.thought, special))
        request = self.requests.prepare(settings, record=True)
        stream = request.streams[0]
        stats = GenerationStats(prompt_tokens=len(ids))
        fed = list(ids)
        steps = request.steps(
            self.engine,
            [ids],
            settings.max_tokens,
            self.requests.eot,
            self.session,
            "recompute",
            reused,
            self.draft_min,
        )
        interrupted = False
        for step in steps:
            stats.update(step)
            on_text(stream.feed(step.tokens[0], step.logprobs[0] if step.logprobs else None))
            fed.append(step.tokens[0])
            if stream.finished:
                break
            if stopped():
                interrupted = True
                break
        on_text(stream.finish("interrupted" if interrupted else "length"))
        # The cache holds every token fed to it: the prompt and each sampled token but the last (never decoded).
        fed = fed[:-1]
        self.cached = fed if len(fed) == self.session.positions else []
        # the answer's reply joins the conversation without its thought, as a client sends an answer's content back
        thought, reply = thinking.split(stream.text, prompt.thought) if prompt.thinks else (None, stream.text)
        self.messages += [Message("user", user), Message("assistant", reply)]
        return Answer(stream.text, stream.finish_reason, stats, reused, stream.tokens, request.seed, thought)

    def _reusable(self, ids: list[int]) -> int:
        """How many of the prompt's first tokens the cache holds at the same positions (one is always left to
        prefill: its logits are the answer's first)."""
        return min(common_start(self.cached, ids), len(ids) - 1)
