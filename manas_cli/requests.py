"""A generation request's parts, built in one place for `generate`, `--jsonl` and the server (the library builds
requests and samplers; the CLI and the server only call it, as in mlx-lm): its seed, chosen when the settings leave
it open; its sampler, made for the engine; and the text streams its rows' tokens become text through."""

from __future__ import annotations

from dataclasses import dataclass

from .engine.batching import Request
from .engine.engines import Engine
from .engine.sampling import Sampler, choose_seed, make_sampler
from .formats.tokenizer import decodable, end_of_text_id
from .settings import GenerationSettings
from .streaming import TextStream


@dataclass(frozen=True)
class Prepared:
    settings: GenerationSettings
    seed: int
    sampler: Sampler
    streams: list[TextStream]  # one per row

    def request(self, key: int, prompt: list[int]) -> Request:
        """The request continuous batching takes (engine/batching.py), for one row."""
        return Request(key, prompt, self.sampler, self.settings.max_tokens, self.settings.logprobs)


class Requests:
    """The requests of one model: what its tokenizer allows and ends with, found once."""

    def __init__(self, engine: Engine, encoding) -> None:
        self.engine, self.encoding = engine, encoding
        self.eot, self.allowed = end_of_text_id(encoding), decodable(encoding)

    def prepare(self, settings: GenerationSettings, rows: int = 1, record: bool = True) -> Prepared:
        """A request of `rows` rows sampled alike (generate's --num-samples); record: keep each row's text and tokens
        (a single streamed sample keeps none)."""
        seed = choose_seed(settings.seed)
        sampler = make_sampler(settings, seed, self.allowed, self.engine)
        streams = [TextStream(self.encoding, self.eot, settings.stop, record) for _ in range(rows)]
        return Prepared(settings, seed, sampler, streams)
