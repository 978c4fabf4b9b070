"""A structured output's constraint compiled in a worker process (worker.py) under a budget of time and memory.

A schema or grammar of a few kilobytes can make llguidance work for minutes and build gigabytes before it says
anything: an `allOf` of 60 string patterns (the intersection of their automata), 10,000 chained GBNF rules (deep
enough to overflow its stack), `^((a{100}){100}){100}$`. Its own limits (LLParserLimits) bound each step, but not
every part of compiling. So a worker compiles the constraint and takes a few steps of a trial walk through it
(where a lexer's blow-up shows), under RLIMIT_CPU and RLIMIT_AS and the caller's wall-clock deadline, and returns
llguidance's grammar, which the caller's matchers then read in milliseconds. A compile past the budget, or one that
kills its worker, is one error naming why; the caller, a server with other requests in flight, goes on.

Compiles run in a pool of up to WORKERS processes, so that one long compile holds one worker, not every request's
turn. A worker is started with the vocabulary (every token's bytes, end-of-text, the special ids) and keeps it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .errors import InputError, first_line
from .worker import Bounds, Worker, serve

BOUNDS = Bounds(
    what="compiling it",
    cpu_s=4,  # a JSON Schema compiles in milliseconds; ^((a{100}){100}){100}$ took 0.9 s to its first mask here
    wall_s=8.0,
    memory_bytes=1024 * 2**20,  # beyond the worker's start: an allOf of 60 patterns asked for 6.9 GB
    reply_bytes=64 * 2**20,  # llguidance's grammar of a 1 MiB schema
)
WORKERS = 4  # compiles at once, each a process of about 100 MB
TRIAL_TOKENS = 8  # steps of the trial walk: the lexer's states for what follows the first token are built lazily
# JSON as json.dumps writes it, the layout models have read most: with whitespace free, a small model fills it with
# newlines until its budget is spent (a schema's "x-guidance" object can set llguidance's other options).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Tokens:
    """What llguidance's TokenizerWrapper reads: the tokens' bytes, end-of-text, the special ids, and a text's
    tokens where llguidance needs them (never for sampling): `encode`'s, or, without it (in a compile worker),
    llguidance's greedy tokenization of the same vocabulary."""

    bos_token_id = None

    def __init__(
        self, tokens: list[bytes], eot: int, special: list[int], encode: Callable[[str], list[int]] | None = None
    ) -> None:
        self.tokens, self.eos_token_id, self.special_token_ids, self.encode = tokens, eot, special, encode
        self.greedy = None  # the LLTokenizer, where there is no `encode`

    def __call__(self, text: str | bytes) -> list[int]:
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        if self.encode is not None:
            return self.encode(text)
        return self.greedy.greedy_tokenize(text) if self.greedy is not None else []


def llg_tokenizer(tokens: Tokens, size: int):
    import llguidance

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(tokens),
        n_vocab=size,
        # no slices (llguidance's precomputed vocabulary splits): measured on SmolLM2's 49,152 tokens, a JSON mask
        # takes 19 µs (median) without them, 18 with, and they double this set-up (0.07 s → 0.15 s)
        slices=[],
    )


def limits():
    """llguidance's bounds on compiling and on each step: its defaults, with errors that name the fault."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=True)


def llg_grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint (ValueError, or what its GBNF converter raises, where it has none)."""
    import llguidance

    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    return llguidance.grammar_from(kind, text)


def reason(message: str) -> str:
    """llguidance's message (several lines for a regular expression's fault, a parser's state after a step's
    error) as one line of at most 300 chars."""
    return first_line(Exception(message.split("\n<state>")[0].replace("\n", " ")), 300)


class CompileRefused(InputError):
    """A constraint that cannot be compiled within the budget, or at all: the message says why."""


class Compilers:
    """The pool of compile workers of one vocabulary (`greeting`: its description, sent to each new worker)."""

    def __init__(self, greeting: dict) -> None:
        self.greeting = {"vocabulary": greeting}
        self._idle: queue.LifoQueue[Worker] = queue.LifoQueue()
        self._started = 0
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str) -> str:
        """llguidance's grammar for a constraint (structured.Format's kind and text), or CompileRefused saying
        why."""
        worker = self._take()
        try:
            return worker.ask({"kind": kind, "text": text})["grammar"]
        finally:
            self._idle.put(worker)

    def _take(self) -> Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._started < WORKERS:
                self._started += 1
                return Worker(__name__, BOUNDS, CompileRefused, self.greeting)
        return self._idle.get()  # every worker is compiling: the first to finish (within BOUNDS.wall_s) is ours


# ---- the worker's side ----


def main() -> None:
    serve(BOUNDS, _Compiler().handle, CompileRefused)


class _Compiler:
    def __init__(self) -> None:
        self.tokenizer = None
        self.eot = -1

    def handle(self, request: dict) -> dict:
        if "vocabulary" in request:
            vocabulary = request["vocabulary"]
            tokens = Tokens([bytes.fromhex(token) for token in vocabulary["tokens"]], *vocabulary["ends"])
            self.tokenizer, self.eot = llg_tokenizer(tokens, len(tokens.tokens)), tokens.eos_token_id
            tokens.greedy = self.tokenizer
            return {}
        return {"grammar": self.compile(request["kind"], request["text"])}

    def compile(self, kind: str, text: str) -> str:
        """The grammar, checked as the caller's matchers will use it: llguidance's own validation, a matcher, and a
        trial walk of TRIAL_TOKENS steps (each taking the smallest allowed id, end-of-text last)."""
        import llguidance

        try:
            grammar = llg_grammar(kind, text)
        except RecursionError:
            raise CompileRefused("it nests too deeply") from None
        except Exception as exc:  # llguidance raises ValueError, or what its GBNF converter meets
            raise CompileRefused(reason(str(exc))) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=limits())
        if error and not error.startswith("WARNING"):
            raise CompileRefused(reason(error))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits())
        for step in range(TRIAL_TOKENS):
            allowed = matcher.compute_logit_bias()
            if matcher.is_error():
                raise CompileRefused(_step_error(matcher, step))
            token = _first_allowed(allowed, 0)
            token = _first_allowed(allowed, self.eot + 1) if token == self.eot else token
            if token is None and not allowed[self.eot]:
                raise CompileRefused("no text can match it")
            if token is None:
                break  # only end-of-text may follow: the text is complete
            if not matcher.consume_token(token):
                raise CompileRefused(_step_error(matcher, step))
        return grammar


def _first_allowed(allowed: bytes, start: int) -> int | None:
    """The smallest id from `start` on that the mask allows (one byte per id), found at C's speed."""
    rest = allowed[start:]
    kept = rest.lstrip(b"\0")
    return start + len(rest) - len(kept) if kept else None


def _step_error(matcher, step: int) -> str:
    message = reason(matcher.get_error())
    if step == 0 and message.startswith("NoExtensionBias"):
        return "no text can match it (a $ref that only refers to itself, or a grammar with no way to end)"
    return f"over llguidance's limits: {message}"
