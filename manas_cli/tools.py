"""Tool calls on the chat endpoint: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` checked; each model
family's own call syntax, written as a grammar that constrains the answer (structured.py); and the answer's calls
parsed back into OpenAI's `tool_calls`.

A model calls tools in the syntax it was tuned on, which its chat template shows (llguidance's docs/toolcalls.md
explains why forcing another one fails):
- "hermes" (Qwen2.5, Hermes 2 Pro, SmolLM3): each call `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  several in a row where parallel calls are allowed;
- "llama3" (Llama 3.1, 3.2): one call, the JSON object `{"name": ..., "parameters": {...}}`.
With tool_choice "required" or a named function the answer is a call from its first token, and may end after any
whole call; with "auto" it is free text that never holds the tag (nor opens with "{" for llama3), or, once it opens
a call, a call: the model chooses, the grammar keeps the call valid. Parsed back, an answer is calls only where it
is nothing but calls to declared functions whose arguments jsonschema finds valid (the grammar is not trusted
alone); any other answer is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .constraint_worker import JSON_LAYOUT
from .errors import InputError, MissingDependencyError
from .schema_normal import normalized
from .structured import INSTALL, Format

MAX_TOOLS = 128
SYNTAXES = ("hermes", "llama3")


class ToolError(InputError):
    """A request's tools that cannot be used as given; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A checked request's tools: the functions by name, what the template is given, and the choice."""

    functions: dict[str, dict]  # name -> {"name", "description"?, "parameters"?} as given
    listed: list[dict]  # the tools as the request gave them, for the chat template
    choice: str  # "none", "auto", "required", or "function" (a named one)
    named: str | None
    parallel: bool


def parse_tools(value: dict) -> Tools | None:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, or None where it has no tools."""
    listed, choice = value.get("tools"), value.get("tool_choice")
    if listed is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(listed, list) or not listed or len(listed) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of 1 to {MAX_TOOLS} function tools", "tools")
    functions = {}
    for i, tool in enumerate(listed):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        if function["name"] in functions:
            raise ToolError(f"tools[{i}]: a second function named {function['name']!r}", "tools")
        functions[function["name"]] = {**function, "parameters": parameters}
    parallel = value.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # OpenAI's default
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    choice, named = _choice(choice, functions)
    return Tools(functions, listed, choice, named, parallel)


def _choice(choice: object, functions: dict) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in functions:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return "function", name


def call_syntax(template: str) -> str | None:
    """The tool-call syntax a chat template shows its model (SYNTAXES), or None: no tools, or a syntax manas does
    not know."""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "respond with a JSON for a function call" in template:
        return "llama3"
    return None


def check_syntax(template: str) -> str:
    """call_syntax, or ToolError naming `tools` for a template without one."""
    syntax = call_syntax(template)
    if syntax is None:
        takes = re.search(r"\btools\b", template) is not None
        raise ToolError(
            "this model's chat template takes tools in a call syntax manas does not know (it knows Hermes/Qwen2.5's "
            "<tool_call> and Llama 3.x's JSON)"
            if takes
            else "this model's chat template takes no tools: it was not tuned to call them",
            "tools",
        )
    return syntax


def call_format(tools: Tools, syntax: str, special_tokens: set[str]) -> Format | None:
    """The grammar every answer must match for these tools (None for tool_choice "none"): Lark, with each call's
    JSON a %json schema. special_tokens: the vocabulary's; a tag that is one is written as that token."""
    if tools.choice == "none":
        return None
    require_jsonschema()
    names = [tools.named] if tools.named else list(tools.functions)
    arguments = "parameters" if syntax == "llama3" else "arguments"
    try:
        schemas = [_call_schema(name, tools.functions[name]["parameters"], arguments) for name in names]
        schema = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
        body = f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"
    except RecursionError:
        raise ToolError("a function's parameters nest too deeply", "tools") from None
    free = tools.choice == "auto"
    if syntax == "llama3":
        # free text never opens with "{", even after whitespace: only a call does
        lines = ["start: TEXT | call" if free else "start: call", f"call: {body}", r"TEXT: /\s*([^{\s](?s:.*))?/"]
    else:
        opening, closing = (_tag(tag, special_tokens) for tag in ("<tool_call>", "</tool_call>"))
        # after any whole call the answer may end, or end after a newline (where a template's turn ends), so the
        # grammar never makes a call that the model ends with "\n" into two
        calls = 'call ("\\n" call)* "\\n"?' if tools.parallel else 'call "\\n"?'
        lines = [
            f"start: TEXT | {calls}" if free else f"start: {calls}",
            f'call: {opening} "\\n" body "\\n" {closing}',
            f"body: {body}",
            # free text never holds the opening tag, spelled in ordinary tokens or as its special one
            r"TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
        ]
    return Format("lark", "\n".join(lines) + "\n")


def require_jsonschema() -> None:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"tool calls need jsonschema: {INSTALL}") from None


def _call_schema(name: str, parameters: dict, arguments: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments: normalized(parameters)[0]},
        "required": ["name", arguments],
        "additionalProperties": False,
    }


def _tag(tag: str, special_tokens: set[str]) -> str:
    return tag if tag in special_tokens else json.dumps(tag)


@dataclass(frozen=True)
class Answer:
    """An answer read for tool calls: its text beside them (None when it is only calls) and the calls."""

    content: str | None
    calls: list[dict]  # OpenAI's tool_calls entries


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def read_calls(text: str, syntax: str, tools: Tools) -> Answer:
    """The calls an answer makes, as OpenAI's tool_calls (each with a fresh id and its arguments as a JSON string):
    an answer that is nothing but calls, each naming a declared function with arguments valid under its
    `parameters` (checked here again, not only trusted to the grammar), is its calls, a call repeated at once
    counted once (a model that wrote a call and then wrote it again is not asking for two); any other answer is
    its text."""
    if syntax == "llama3":
        found = [text.strip()] if text.lstrip().startswith("{") else []
        arguments = "parameters"
    else:
        found = _hermes_calls(text)
        arguments = "arguments"
    calls: list[tuple[str, object]] = []
    for raw in found:
        call = _declared_call(raw, arguments, tools)
        if call is None:
            return Answer(text, [])
        if not calls or calls[-1] != call:
            calls.append(call)
    if not calls:
        return Answer(text, [])
    return Answer(
        None,
        [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(values, ensure_ascii=False)},
            }
            for name, values in calls
        ],
    )


def _hermes_calls(text: str) -> list[str]:
    """The JSON of each tagged call, where the text is nothing but calls and whitespace; else none."""
    found, end = [], 0
    for match in HERMES_CALL.finditer(text):
        if text[end : match.start()].strip():
            return []
        found.append(match.group(1))
        end = match.end()
    return found if not text[end:].strip() else []


def _declared_call(raw: str, arguments: str, tools: Tools) -> tuple[str, object] | None:
    """(name, arguments) of one call's JSON, or None unless it names a function the request may call (the named
    one, under a named tool_choice) and its arguments are valid under that function's schema."""
    try:
        call = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or set(call) != {"name", arguments} or not isinstance(call["name"], str):
        return None
    name = call["name"]
    if name not in tools.functions or (tools.named is not None and name != tools.named):
        return None
    if not valid(call[arguments], tools.functions[name]["parameters"]):
        return None
    return name, call[arguments]


PATTERN_TIMEOUT_S = 0.1  # a pattern that backtracks for longer over a model's short string is not trusted to pass


def valid(instance: object, schema: dict) -> bool:
    """Whether `instance` is valid under the JSON Schema, by jsonschema (a validator independent of the grammar
    that made it), its patterns matched by `regex` under a timeout: Python's `re`, which jsonschema uses, can
    backtrack for hours on a hostile pattern."""
    import jsonschema

    checker = jsonschema.validators.validator_for(schema)
    bounded = jsonschema.validators.extend(checker, {"pattern": _pattern, "patternProperties": _pattern_properties})
    try:
        return bounded(schema).is_valid(instance)
    except Exception:  # a schema jsonschema refuses, an unresolvable $ref, a pattern `regex` cannot compile, a
        return False  # recursion too deep: not shown valid


def _search(pattern: str, text: str) -> bool:
    import regex

    try:
        return regex.search(pattern, text, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError:
        return False


def _pattern(validator, pattern, instance, schema):
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if validator.is_type(instance, "object"):
        for pattern, subschema in patterns.items():
            for key, value in instance.items():
                if _search(pattern, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=pattern)
