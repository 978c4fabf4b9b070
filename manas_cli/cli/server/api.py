"""OpenAI's completions API as manas serves it: a request body checked field by field into settings, and the
response and stream-chunk shapes. Pure functions of JSON values: no sockets, no engine."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...settings import GenerationSettings, check, strict_json

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # n × prompts per request
MAX_STOPS = 16

# OpenAI's fields and manas's own extras, by the setting each one sets (None: handled apart, or accepted only).
FIELDS = {
    "model": None,
    "prompt": None,
    "n": None,
    "stream": None,
    "stream_options": None,
    "echo": None,
    "user": None,
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
    "logprobs": "logprobs",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "repeat_last_n": "repeat_last_n",
    "best_of": None,
    "logit_bias": None,
}
# Fields clients send with their defaults (LangChain, llm): taken at these values, refused, by name, at any other.
HARMLESS = {"best_of": (None, 1), "logit_bias": (None, {})}


class RequestError(ValueError):
    """A request OpenAI's API would refuse with this status; `param` names the field at fault."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Completion:
    """A checked /v1/completions request."""

    prompts: list[str]
    n: int
    settings: GenerationSettings
    stream: bool
    include_usage: bool
    echo: bool


def parse_json(body: bytes) -> object:
    try:
        value = strict_json(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(f"the body is not UTF-8 (byte {exc.start + 1}): send UTF-8 JSON") from None
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"the body is not JSON: {exc}") from None
    if _has_lone_surrogate(value):
        raise RequestError(
            "the body holds a lone surrogate escape (\\ud800 to \\udfff unpaired): that is no "
            "character; send UTF-8 text"
        )
    return value


def _has_lone_surrogate(value: object) -> bool:
    """Whether any string in a parsed JSON value holds an unpaired surrogate (JSON's \\uD800 escapes allow one;
    no text can be encoded from it)."""
    if isinstance(value, str):
        return not value.isascii() and any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(_has_lone_surrogate(v) for v in value)


def parse_completion(value: object, max_tokens: int) -> Completion:
    """The request's fields, each checked by generate's own rule; RequestError names the first that is wrong.
    max_tokens: the server's ceiling on a choice's tokens (serve --max-tokens)."""
    if not isinstance(value, dict):
        raise RequestError(f"the body must be a JSON object, not {type(value).__name__}")
    for name in value:
        if name not in FIELDS:
            raise RequestError(f"unknown field {name!r}: manas takes {', '.join(FIELDS)}", param=name)
    for name, accepted in HARMLESS.items():
        if value.get(name) not in accepted:
            raise RequestError(
                f"{name} {json.dumps(value[name])[:40]} is not supported: manas takes "
                f"{' or '.join(json.dumps(a) for a in accepted)}",
                param=name,
            )
    prompts = _prompts(value.get("prompt"))
    n = _integer(value, "n", 1, 1, MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
        raise RequestError(f"n × prompts is {n * len(prompts)}: at most {MAX_CHOICES} choices a request", param="n")
    overrides = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": 1.0}  # OpenAI's defaults
    for name, setting in FIELDS.items():
        if setting is not None and value.get(name) is not None:
            overrides[setting] = value[name]
    if isinstance(overrides.get("stop"), str):
        overrides["stop"] = [overrides["stop"]]
    if len(overrides.get("stop", ())) > MAX_STOPS:
        raise RequestError(f"at most {MAX_STOPS} stop sequences", param="stop")
    settings = GenerationSettings()
    checked = {}
    for name, setting in overrides.items():
        try:
            checked[name] = check(name, setting)
        except ValueError as exc:
            raise RequestError(str(exc), param=next(f for f, s in FIELDS.items() if s == name)) from None
    if checked["max_tokens"] > max_tokens:
        raise RequestError(
            f"max_tokens {checked['max_tokens']:,} is over this server's limit of {max_tokens:,} "
            "(manas serve --max-tokens)",
            param="max_tokens",
        )
    stream = _boolean(value, "stream")
    options = value.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options takes only include_usage", param="stream_options")
    if options and not stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    for name in ("model", "user"):
        if value.get(name) is not None and not isinstance(value[name], str):
            raise RequestError(f"{name} must be a string", param=name)
    return Completion(
        prompts,
        n,
        GenerationSettings(**{**settings.__dict__, **checked}),
        stream,
        _boolean(options, "include_usage"),
        _boolean(value, "echo"),
    )


def _prompts(prompt: object) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    raise RequestError(
        "prompt must be a string or a non-empty list of strings (token arrays are not taken)", param="prompt"
    )


def _integer(value: dict, name: str, default: int, low: int, high: int) -> int:
    number = value.get(name, default)
    if number is None:
        return default
    if not isinstance(number, int) or isinstance(number, bool) or not low <= number <= high:
        raise RequestError(f"{name} must be an integer from {low} to {high}, got {number!r}", param=name)
    return number


def _boolean(value: dict, name: str) -> bool:
    flag = value.get(name, False)
    if flag is None:
        return False
    if not isinstance(flag, bool):
        raise RequestError(f"{name} must be true or false, got {flag!r}", param=name)
    return flag


FINISH_REASONS = {"length": "length", "stop": "stop", "end_of_text": "stop"}


def legacy_logprobs(entries: list[dict], offset: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs (token → logprob), text_offset."""
    offsets, position = [], offset
    for entry in entries:
        offsets.append(position)
        position += len(entry["text"])
    return {
        "tokens": [entry["text"] for entry in entries],
        "token_logprobs": [entry["logprob"] for entry in entries],
        "top_logprobs": [{top["text"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(request_id: str, created: int, model: str, choices: list[dict], usage_: dict | None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def choice_body(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
