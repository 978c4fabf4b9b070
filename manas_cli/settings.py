"""What one generation request may set, with the ranges that both generate's flags and --jsonl's lines obey.
Kept free of heavy imports: the CLI checks flags before torch loads."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_DRAFT = 64  # the most tokens one speculative check takes (--draft-max)


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as a request asks for it (engine/speculation.py; the text is the same either way):
    prompt lookup with n-grams of up to `lookup` tokens, or the draft model the command or server holds (`draft`),
    or the text the client predicts (OpenAI's `prediction`); up to draft_max tokens a check. All off: none."""

    lookup: int = 0
    draft: bool = False
    draft_max: int = 4  # speculation.DEFAULT_DRAFT_MAX
    prediction: str | None = None

    @property
    def on(self) -> bool:
        return bool(self.lookup or self.draft or self.prediction)

    def record(self) -> dict:
        """As a --jsonl line's "speculative" gives it (speculation_from reads it back; {}: none)."""
        return {
            **({"lookup": self.lookup} if self.lookup else {}),
            **({"draft": True} if self.draft else {}),
            "draft_max": self.draft_max,
        }


SPECULATIVE_KEYS = {
    "lookup": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "draft": ("true or false", lambda v: isinstance(v, bool)),
    "draft_max": (f"an integer from 1 to {MAX_DRAFT}", lambda v: _integer(v) and 1 <= v <= MAX_DRAFT),
}


def speculation_from(value: object) -> Speculation:
    """A request's "speculative" object ({"lookup": N, "draft": true, "draft_max": K}, each optional), or false
    for none (where the command or server speculates by default), checked; ValueError says what is wrong."""
    if value is False:
        return Speculation()
    if not isinstance(value, dict):
        raise ValueError(f"speculative must be an object with {', '.join(SPECULATIVE_KEYS)}, got {value!r}")
    for key, given in value.items():
        if key not in SPECULATIVE_KEYS:
            raise ValueError(f"speculative has {key!r}: it takes {', '.join(SPECULATIVE_KEYS)}")
        rule, keeps = SPECULATIVE_KEYS[key]
        if not keeps(given):
            raise ValueError(f"speculative.{key} must be {rule}, got {given!r}")
    return Speculation(**value)


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 200  # -1: until the end of text or the window, as llama.cpp's -n -1 (see token_budget)
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    parse_special: bool = True  # special-token text in the prompt (<|im_start|>) is those tokens, as transformers does
    format: object | None = None  # structured.Format: a JSON Schema, grammar or regex every text must match
    speculative: Speculation | None = None  # None: as the command or server runs (its --lookup, --draft-model)

    def record(self) -> dict:
        """The sampling settings a --json record reports (its seed and logprobs are fields of their own)."""
        reported = (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "repeat_last_n",
            "frequency_penalty",
            "presence_penalty",
        )
        return {name: getattr(self, name) for name in reported}


# name -> (the rule, as an error states it; whether a value keeps it). None is allowed where the default is None.
RULES = {
    "max_tokens": (
        "an integer >= 1, or -1 (until the end of text or the window)",
        lambda v: _integer(v) and (v >= 1 or v == -1),
    ),
    "temperature": ("a finite number >= 0", lambda v: _number(v) and v >= 0),
    "top_k": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "top_p": ("a number with 0 < top_p <= 1", lambda v: _number(v) and 0 < v <= 1),
    "min_p": ("a number with 0 <= min_p <= 1", lambda v: _number(v) and 0 <= v <= 1),
    "repetition_penalty": ("a number > 0 (1 is none)", lambda v: _number(v) and v > 0),
    "repeat_last_n": ("an integer >= -1 (-1: the whole window, 0: none)", lambda v: _integer(v) and v >= -1),
    "frequency_penalty": ("a number from -2 to 2", lambda v: _number(v) and -2 <= v <= 2),
    "presence_penalty": ("a number from -2 to 2", lambda v: _number(v) and -2 <= v <= 2),
    "seed": (
        "an integer with 0 <= seed < 2^64 (2^64 = 18446744073709551616)",
        lambda v: _integer(v) and 0 <= v < 2**64,
    ),
    "stop": (
        "a list of non-empty strings",
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
    ),
    "logprobs": (f"an integer from 0 to {MAX_LOGPROBS}", lambda v: _integer(v) and 0 <= v <= MAX_LOGPROBS),
    "parse_special": ("true or false", lambda v: isinstance(v, bool)),
    "speculative": (
        "an object (lookup, draft, draft_max), or false",
        lambda v: v is False or isinstance(v, (dict, Speculation)),
    ),
}


def check(name: str, value: object) -> object:
    """value, when it keeps the setting's rule (None where the setting may be unset); else ValueError naming both."""
    default = GenerationSettings.__dataclass_fields__[name].default
    if value is None and default is None:
        return value
    rule, keeps = RULES[name]
    if not keeps(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    if name == "speculative" and not isinstance(value, Speculation):
        return speculation_from(value)
    return tuple(value) if name == "stop" else value


FORMAT_KEYS = ("json_schema", "grammar", "grammar_syntax", "regex")  # a record's structured output (structured.py)


def with_overrides(settings: GenerationSettings, overrides: dict) -> GenerationSettings:
    """settings with a request's own values, each checked; ValueError names an unknown or invalid one. A record's
    json_schema, grammar (with grammar_syntax) or regex replaces the defaults' structured output."""
    checked = {}
    for name, value in overrides.items():
        if name in FORMAT_KEYS:
            continue
        if name not in RULES:
            raise ValueError(f"unknown key {name!r} (known: prompt, id, {', '.join((*RULES, *FORMAT_KEYS))})")
        checked[name] = check(name, value)
    if any(overrides.get(name) is not None for name in FORMAT_KEYS):
        from .structured import format_from_record

        checked["format"] = format_from_record(overrides)
    return GenerationSettings(**{**settings.__dict__, **checked})


def as_overrides(settings: GenerationSettings) -> dict:
    """settings as with_overrides takes them (the keys of a --jsonl record): plain JSON values."""
    values = {name: value for name, value in settings.__dict__.items() if name not in ("format", "speculative")}
    if settings.speculative is not None:
        values["speculative"] = settings.speculative.record()
    return {**values, **(settings.format.record() if settings.format is not None else {})}


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def strict_json(text: str) -> object:
    """JSON as the standard defines it, for --jsonl's lines and the server's bodies: NaN and Infinity (which
    Python's reader takes) are refused, and so is a number no float holds (1e400); a record or answer that echoed
    either would not be JSON. ValueError (or RecursionError, for nesting too deep) says what is wrong."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


def token_budget(max_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """The tokens a request may generate: max_tokens, or for -1 what fills the window after its prompt (at least
    one)."""
    return max_tokens if max_tokens != -1 else max(1, block_size - prompt_tokens)
