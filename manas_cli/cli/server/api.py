"""OpenAI's completions API as manas serves it: a request body checked field by field into settings, and the
response and stream-chunk shapes. Pure functions of JSON values: no sockets, no engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ...settings import MAX_LOGPROBS, GenerationSettings, Speculation, check, strict_json

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
    "parse_special": "parse_special",  # manas's: false keeps special-token text in the prompt plain text
    "best_of": None,
    "logit_bias": None,
    "response_format": None,  # OpenAI's structured output
    "json_schema": None,  # llama-server's: a JSON Schema
    "grammar": None,  # llama-server's: a GBNF grammar (or Lark)
    "speculative": "speculative",  # manas's: {"lookup": N, "draft": true, "draft_max": K} (speculation.py)
    "prediction": None,  # OpenAI's Predicted Outputs: {"type": "content", "content": ...}, proposed as it goes
}
# /v1/chat/completions': messages in place of prompt, logprobs a flag with top_logprobs its count.
CHAT_FIELDS = {
    **{
        name: setting
        for name, setting in FIELDS.items()
        if name not in ("prompt", "echo", "logprobs", "best_of", "parse_special")
    },
    "messages": None,
    "max_completion_tokens": "max_tokens",
    "logprobs": None,
    "top_logprobs": None,
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": None,
    "chat_template_kwargs": None,  # vLLM's and llama-server's: variables for the template (enable_thinking)
}
FORMAT_FIELDS = ("response_format", "json_schema", "grammar")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
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
    format_field: str | None = None  # the field that asked for settings.format, named in its errors


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
    no text can be encoded from it). A walk with a stack, not recursion: a JSON Schema may nest deeper than
    Python's recursion limit."""
    pending = [value]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            if not value.isascii() and any("\ud800" <= c <= "\udfff" for c in value):
                return True
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


@dataclass(frozen=True)
class ChatRequest:
    """A checked /v1/chat/completions request; top_logprobs None: no logprobs."""

    messages: list
    n: int
    settings: GenerationSettings
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    format_field: str | None = None
    tools: object | None = None  # tools.Tools
    template_kwargs: dict | None = None
    # Where the answer starts with respect to a thought (thinking.py), once the prompt is rendered; None: the model's
    # template does not think, and its answers have no reasoning_content
    thought: str | None = None


def parse_completion(value: object, max_tokens: int) -> Completion:
    """The request's fields, each checked by generate's own rule; RequestError names the first that is wrong.
    max_tokens: the server's ceiling on a choice's tokens (serve --max-tokens)."""
    _check_fields(value, FIELDS)
    prompts = _prompts(value.get("prompt"))
    n = _integer(value, "n", 1, 1, MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
        raise RequestError(f"n × prompts is {n * len(prompts)}: at most {MAX_CHOICES} choices a request", param="n")
    stream, include_usage = _stream_options(value)
    settings = _settings(value, FIELDS, max_tokens, DEFAULT_MAX_TOKENS)
    format, field = _format(value)
    settings = GenerationSettings(
        **{**settings.__dict__, "format": format, "speculative": _speculative(value, settings)}
    )
    return Completion(prompts, n, settings, stream, include_usage, _boolean(value, "echo"), field)


def parse_chat(value: object, max_tokens: int) -> ChatRequest:
    """A chat request's fields, checked as a completion's; its messages by chat.parse_messages. Without max_tokens
    (or max_completion_tokens) a choice may run to the server's ceiling, as OpenAI's chat answers run to the end."""
    from ...chat import check_template_kwargs, parse_messages

    _check_fields(value, CHAT_FIELDS)
    if value.get("max_tokens") is not None and value.get("max_completion_tokens") is not None:
        raise RequestError("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    try:
        messages = parse_messages(value.get("messages"))
    except ValueError as exc:
        raise RequestError(str(exc), param="messages") from None
    n = _integer(value, "n", 1, 1, MAX_CHOICES)
    stream, include_usage = _stream_options(value)
    logprobs = _boolean(value, "logprobs")
    top = _integer(value, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if value.get("top_logprobs") is not None and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    settings = _settings(value, CHAT_FIELDS, max_tokens, max_tokens)
    if logprobs:  # the core reports the chosen token's with at least one alternative; the reply keeps `top`
        settings = GenerationSettings(**{**settings.__dict__, "logprobs": max(1, top)})
    format, field = _format(value)
    tools = _tools(value)
    if tools is not None and tools.choice != "none" and field is not None:
        raise RequestError(f"give tools or {field}, not both: a tool call's arguments follow its schema", param=field)
    settings = GenerationSettings(
        **{**settings.__dict__, "format": format, "speculative": _speculative(value, settings)}
    )
    try:
        kwargs = check_template_kwargs(value.get("chat_template_kwargs"))
    except ValueError as exc:
        raise RequestError(str(exc), param="chat_template_kwargs") from None
    return ChatRequest(messages, n, settings, stream, include_usage, top if logprobs else None, field, tools, kwargs)


def _speculative(value: dict, settings: GenerationSettings) -> Speculation | None:
    """The request's speculative decoding: its `speculative` (checked with the settings), with OpenAI's
    `prediction` ({"type": "content", "content": a string, or text parts}) as what it proposes from."""
    predicted = value.get("prediction")
    if predicted is None:
        return settings.speculative
    content = predicted.get("content") if isinstance(predicted, dict) else None
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        content = "".join(part["text"] for part in content)
    if not isinstance(predicted, dict) or predicted.get("type") != "content" or not isinstance(content, str):
        raise RequestError(
            'prediction must be {"type": "content", "content": a string or a list of text parts}', param="prediction"
        )
    if set(predicted) - {"type", "content"}:
        raise RequestError("prediction takes type and content", param="prediction")
    return replace(settings.speculative or Speculation(), prediction=content, lookup=0, draft=False)


def _tools(value: dict):
    from ...tools import ToolError, parse_tools

    try:
        return parse_tools(value)
    except ToolError as exc:
        raise RequestError(str(exc), param=exc.param) from None


def _format(value: dict):
    """The structured output a request asks for (structured.Format, or None) and the field that asks: OpenAI's
    response_format, or llama-server's json_schema or grammar; at most one."""
    from ...errors import InputError
    from ...structured import grammar_format, json_schema_format

    given = [name for name in FORMAT_FIELDS if value.get(name) is not None]
    if len(given) > 1:
        raise RequestError(f"give one of {', '.join(FORMAT_FIELDS)}, not {' and '.join(given)}", param=given[1])
    if not given:
        return None, None
    field, asked = given[0], value[given[0]]
    try:
        if field == "json_schema":
            return json_schema_format(asked, "json_schema"), field
        if field == "grammar":
            if not isinstance(asked, str):
                raise InputError("grammar must be a string (GBNF, or Lark)")
            return grammar_format(asked, "auto", "grammar"), field
        format = _response_format(asked)
        return format, field if format is not None else None
    except InputError as exc:
        raise RequestError(str(exc), param=field) from None


def _response_format(asked: object):
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} (any JSON object), or {"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}; and llama-server's own form
    {"type": "json_object", "schema": {...}} (instructor's JSON_SCHEMA mode sends it), a schema. Any other key is
    refused by name: a field ignored would be a constraint silently not applied."""
    from ...errors import InputError
    from ...structured import json_schema_format

    kind = asked.get("type") if isinstance(asked, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise InputError(f"response_format must be an object whose type is {', '.join(RESPONSE_FORMATS)}")
    takes = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}[kind]
    if unknown := sorted(set(asked) - takes):
        raise InputError(
            f"response_format has {unknown[0]!r}: a {kind!r} response_format takes {', '.join(sorted(takes))}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        if asked.get("schema") is not None:
            return json_schema_format(asked["schema"], "response_format.schema")
        return json_schema_format({"type": "object"})
    spec = asked.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InputError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
    if unknown := sorted(set(spec) - {"name", "schema", "strict", "description"}):
        raise InputError(f"response_format.json_schema has {unknown[0]!r} (it takes name, schema, strict, description)")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InputError("response_format.json_schema.strict must be true or false")
    return json_schema_format(spec.get("schema", True), "response_format.json_schema.schema")


def _check_fields(value: object, fields: dict) -> None:
    if not isinstance(value, dict):
        raise RequestError(f"the body must be a JSON object, not {type(value).__name__}")
    for name in value:
        if name not in fields:
            raise RequestError(f"unknown field {name!r}: manas takes {', '.join(fields)}", param=name)
    for name, accepted in HARMLESS.items():
        if value.get(name) not in accepted:
            raise RequestError(
                f"{name} {json.dumps(value[name])[:40]} is not supported: manas takes "
                f"{' or '.join(json.dumps(a) for a in accepted)}",
                param=name,
            )
    for name in ("model", "user"):
        if value.get(name) is not None and not isinstance(value[name], str):
            raise RequestError(f"{name} must be a string", param=name)


def _settings(value: dict, fields: dict, max_tokens: int, default_max_tokens: int) -> GenerationSettings:
    """The generation settings a request's fields set, over OpenAI's defaults, each checked by generate's rule."""
    # OpenAI's max_tokens default; manas's one temperature (0.8, llama.cpp's and ollama's), so a seeded answer is
    # the same from generate, chat, batch and the server without flags
    overrides = {"max_tokens": default_max_tokens, "temperature": GenerationSettings.temperature}
    for name, setting in fields.items():
        if setting is not None and value.get(name) is not None:
            overrides[setting] = value[name]
    if isinstance(overrides.get("stop"), str):
        overrides["stop"] = [overrides["stop"]]
    if len(overrides.get("stop", ())) > MAX_STOPS:
        raise RequestError(f"at most {MAX_STOPS} stop sequences", param="stop")
    checked = {}
    for name, setting in overrides.items():
        try:
            if name == "max_tokens" and (type(setting) is not int or setting < 1):  # no -1: a server has a ceiling
                raise ValueError(f"max_tokens must be an integer >= 1, got {setting!r}")
            checked[name] = check(name, setting)
        except ValueError as exc:
            given = [f for f, s in fields.items() if s == name and value.get(f) is not None]
            raise RequestError(str(exc), param=(given or [name])[0]) from None
    if checked["max_tokens"] > max_tokens:
        raise RequestError(
            f"max_tokens {checked['max_tokens']:,} is over this server's limit of {max_tokens:,} "
            "(manas serve --max-tokens)",
            param="max_completion_tokens" if value.get("max_completion_tokens") is not None else "max_tokens",
        )
    return GenerationSettings(**{**GenerationSettings().__dict__, **checked})


def _stream_options(value: dict) -> tuple[bool, bool]:
    """stream, and stream_options.include_usage (only with stream)."""
    stream = _boolean(value, "stream")
    options = value.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options takes only include_usage", param="stream_options")
    if options and not stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    return stream, _boolean(options, "include_usage")


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


def usage(prompt_tokens: int, completion_tokens: int, speculated: tuple[int, int] | None = None) -> dict:
    """OpenAI's usage; speculated: (proposed, accepted) tokens where the request speculated, as OpenAI reports a
    prediction's (completion_tokens_details)."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if speculated is not None:
        proposed, accepted = speculated
        counts["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": proposed - accepted,
        }
    return counts


def completion_body(
    request_id: str, created: int, model: str, choices: list[dict], usage_: dict | None, kind: str = "text_completion"
) -> dict:
    """A whole answer: `kind` is the object OpenAI names it (text_completion, chat.completion)."""
    body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def choice_body(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- the chat shapes ----


def chat_logprobs(entries: list[dict], top: int) -> dict:
    """OpenAI's chat logprobs: each token's text, logprob and bytes, with its `top` most likely alternatives."""

    def shown(entry: dict) -> dict:
        return {"token": entry["text"], "logprob": entry["logprob"], "bytes": entry["bytes"]}

    return {
        "content": [
            {**shown(entry), "top_logprobs": [shown(alternative) for alternative in entry["top_logprobs"][:top]]}
            for entry in entries
        ]
    }


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict | None,
    *,
    thinks: bool = False,
    reasoning: str | None = None,
) -> dict:
    """A thinking model's message (thinks) carries its thought as reasoning_content, None where it had none (as
    vLLM's reasoning parsers return it); another model's has no such field."""
    message = {"role": "assistant", "content": text} | ({"reasoning_content": reasoning} if thinks else {})
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_call_deltas(calls: list[dict]) -> list[dict]:
    """A stream's deltas for whole tool calls, as OpenAI streams them: each call's index, id, type and name, then
    its arguments."""
    deltas = []
    for index, call in enumerate(calls):
        function = call["function"]
        named = {"index": index, "id": call["id"], "type": "function", "function": {"name": function["name"]}}
        deltas.append({"tool_calls": [{**named, "function": {**named["function"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]})
    return deltas


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict, finish_reason, logprobs) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
