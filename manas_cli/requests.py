"""A generation request's parts, built in one place for `generate`, `--jsonl` and the server (the library builds
requests and samplers; the CLI and the server only call it, as in mlx-lm): its seed, chosen when the settings leave
it open; its sampler, made for the engine; the text streams its rows' tokens become text through; and the prompt's
token ids, cropped to the window."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .engine.batching import Request
from .engine.engines import Engine
from .engine.generation import Step, generate
from .engine.sampling import Sampler, choose_seed, make_sampler
from .engine.speculation import DraftProposer, Propose, generate_speculative, lookup_proposer, prediction_proposer
from .errors import InputError
from .formats.tokenizer import bos_id, decodable, encode_text, end_of_text_id, longest_token_bytes
from .settings import GenerationSettings, Speculation, token_budget
from .streaming import TextStream


@dataclass(frozen=True)
class Prepared:
    settings: GenerationSettings
    seed: int
    sampler: Sampler
    streams: list[TextStream]  # one per row
    block_size: int  # the window, which max_tokens -1 fills
    proposer: Callable[[], Propose] | None = None  # speculative decoding's: a fresh proposer for each row
    draft_max: int = Speculation.draft_max

    def steps(
        self, engine: Engine, rows, max_tokens: int, eot: int | None, session, overflow: str = "recompute",
        reuse: int = 0, draft_min: int = 0,
    ) -> Iterator[Step]:  # fmt: skip
        """The request's steps on `session` (generation.generate's), its proposals checked where it speculates (one
        row: speculation.generate_speculative's, at least draft_min tokens a check)."""
        logprobs = self.settings.logprobs
        if self.proposer is None:
            return generate(engine, rows, self.sampler, max_tokens, eot, overflow, session, logprobs, reuse)
        return generate_speculative(
            engine, rows, self.sampler, max_tokens, eot, session, self.proposer(), self.draft_max, logprobs, overflow,
            reuse, draft_min,
        )  # fmt: skip

    def request(self, key: int, prompt: list[int]) -> Request:
        """The request continuous batching takes (engine/batching.py), for one row."""
        budget = token_budget(self.settings.max_tokens, len(prompt), self.block_size)
        return Request(key, prompt, self.sampler, budget, self.settings.logprobs, self.proposer, self.draft_max)


COMPILED_KEPT = 32


class Requests:
    """The requests of one model: what its tokenizer allows and ends with, found once."""

    def __init__(
        self, engine: Engine, encoding, draft: Engine | None = None, speculative: Speculation | None = None
    ) -> None:
        """draft: the draft model a request's speculative.draft asks for (--draft-model); speculative: what a
        request that says nothing of it runs (--lookup, --draft-model)."""
        self.engine, self.encoding = engine, encoding
        self.draft, self.speculative = draft, speculative
        self.eot, self.allowed = end_of_text_id(encoding), decodable(encoding)
        self._vocabulary = None  # structured.Vocabulary, built at the first constrained request
        self._grammars: dict = {}  # (Format, field) -> structured.Grammar, the last COMPILED_KEPT compiled
        self._lock = threading.Lock()  # held for the vocabulary's build and the dictionary, never across a compile

    def grammar(self, format, field: str = ""):
        """A structured output's Format compiled for this model (structured.Grammar), or None for none; InputError
        (naming `field` where given) when it cannot be compiled, MissingDependencyError without llguidance.
        Compiles run in worker processes under a budget (constraint_worker.py), several at once: a long one delays
        no other request."""
        if format is None:
            return None
        from .structured import Vocabulary, compile_format

        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(self.encoding, self.eot)
            vocabulary, compiled = self._vocabulary, self._grammars.get((format, field))
        if compiled is not None:  # --jsonl's lines often share one schema
            return compiled
        compiled = compile_format(format, vocabulary, field)
        with self._lock:
            if len(self._grammars) >= COMPILED_KEPT:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[format, field] = compiled
        return compiled

    def prepare(self, settings: GenerationSettings, rows: int = 1, record: bool = True, grammar=None) -> Prepared:
        """A request of `rows` rows sampled alike (generate's --num-samples); record: keep each row's text and tokens
        (a single streamed sample keeps none). grammar: settings.format compiled (Requests.grammar), when the
        caller compiled it already; else it is compiled here."""
        seed = choose_seed(settings.seed)
        grammar = grammar if grammar is not None else self.grammar(settings.format)
        sampler = make_sampler(settings, seed, self.allowed, self.engine, grammar)
        streams = [TextStream(self.encoding, self.eot, settings.stop, record) for _ in range(rows)]
        speculative = settings.speculative if settings.speculative is not None else self.speculative
        speculating = speculative is not None and speculative.on
        proposer = self.proposer(speculative, sampler, rows) if speculating else None
        draft_max = speculative.draft_max if speculating else Speculation.draft_max
        return Prepared(settings, seed, sampler, streams, self.engine.config.block_size, proposer, draft_max)

    def proposer(self, speculative: Speculation, sampler: Sampler, rows: int) -> Callable[[], Propose]:
        """A request's speculative decoding, checked (InputError): a function giving each row its own proposer."""
        block_size = self.engine.config.block_size
        if not hasattr(self.engine.new_session(), "check"):
            raise InputError("speculative decoding runs on the native engine, whose checks give each step's bits")
        if rows != 1:
            raise InputError("speculative decoding decodes one sample at a time (n = 1)")
        if speculative.lookup >= block_size:
            raise InputError(
                f"speculative.lookup takes 1 to {block_size - 1} tokens (the window), got {speculative.lookup}"
            )
        if speculative.prediction is not None:
            # more characters than the window's tokens can cover is refused before it is encoded
            covered = block_size * longest_token_bytes(self.encoding)
            predicted = encode_text(self.encoding, speculative.prediction[: covered + 1])
            if len(predicted) > block_size:
                raise InputError(f"the prediction is more tokens than the model's window of {block_size}")
            return lambda: prediction_proposer(predicted)
        if speculative.lookup:
            return lambda: lookup_proposer(speculative.lookup)
        if self.draft is None:
            raise InputError("speculative.draft asks for a draft model, and none runs here (--draft-model)")
        draft, eot = self.draft, self.eot
        return lambda: DraftProposer(draft, sampler, eot)


# The most prompt characters ever encoded: a window's worth for GPT-2 (1024 tokens of up to 128 bytes, twice over),
# and well under the whitespace run (~10^6 characters) that overflows tiktoken's regex stack.
PROMPT_TAIL_CHARS = 300_000


def encode_prompt(
    checkpoint, text: str, notify: Callable[[str], None] = lambda notice: None, special: bool = True
) -> list[int]:
    """Token ids of the prompt, after the tokenizer's BOS where it has one, cropped to the window with a notice; the
    empty prompt is the BOS, else end-of-text. A crop is told to `notify` (a console's print, or nothing). Special
    tokens written in the text (<|im_start|>) are those tokens, as transformers' tokenizer and llama.cpp encode
    them, unless not `special` (text that must not control the model: --no-special, "parse_special": false).

    Only the text that can reach the window is encoded: block_size tokens never span more than block_size times
    the longest token's bytes in characters, so twice that (the tokens at the cut may differ, and are cropped) is
    exact, up to PROMPT_TAIL_CHARS. That bound also keeps any whitespace run far below the length (~10^6
    characters) at which tiktoken's regex engine overflows its stack and panics."""
    block_size = checkpoint.model.config.block_size
    tail = min(2 * block_size * longest_token_bytes(checkpoint.encoding), PROMPT_TAIL_CHARS)
    cut = len(text) > tail
    bos = bos_id(checkpoint.encoding)
    ids = ([] if bos is None else [bos]) + encode_text(checkpoint.encoding, text[-tail:] if cut else text, special)
    if not ids:
        eot = end_of_text_id(checkpoint.encoding)
        if eot is None:
            raise InputError("the prompt is empty and this model's vocabulary has no <|endoftext|> to start from")
        ids = [eot]
    if cut:
        notify(
            f"notice: the prompt has {len(text)} characters; encoding its last {tail} and keeping its last "
            f"{min(len(ids), block_size)} tokens (the model's block_size is {block_size})"
        )
    elif len(ids) > block_size:
        notify(f"notice: the prompt has {len(ids)} tokens; keeping its last {block_size} (the model's block_size)")
    return ids[-block_size:]
