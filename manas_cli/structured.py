"""Structured outputs: a JSON Schema, a grammar (llama.cpp's GBNF, or Lark as llguidance reads it) or a regular
expression that every generated text must match, enforced token by token.

The constraint engine is llguidance (the library behind llama.cpp's optional grammar backend and vLLM's and
SGLang's `guidance` backend), an optional extra: `pip install "manas-cli[structured]"`. It is given the checkpoint's
own vocabulary (every token's bytes, the special tokens, end-of-text) and returns, before each token, which ids may
follow the text so far. The sampler draws among those only (engine/constraints.py): the mask depends on the request's
own tokens alone, so a constrained text is as exact as any other (cached == crop-and-recompute, batched == alone).

Everything here is untrusted input: a schema or grammar is bounded in size before it is compiled, compiled in a
worker process under a budget of time and memory (constraint_worker.py), and each step is bounded by llguidance's
own limits (LLParserLimits); what it cannot compile is one error naming why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .constraint_worker import Compilers, Tokens, limits, llg_tokenizer
from .errors import InputError, MissingDependencyError
from .formats.tokenizer import decodable, encode_text, vocabulary_size
from .schema_normal import normalized

KINDS = ("json_schema", "gbnf", "lark", "grammar", "regex")  # "grammar": GBNF or Lark, told apart by its text
GRAMMAR_SYNTAXES = ("auto", "gbnf", "lark")
MAX_FORMAT_BYTES = 1 << 20  # a schema or grammar larger than 1 MiB is refused before it is parsed
INSTALL = 'pip install "manas-cli[structured]" (from a clone: pip install -e ".[structured]")'


@dataclass(frozen=True)
class Format:
    """What a request's text must be: kind (KINDS) and its text (a schema as JSON text, a grammar, a pattern)."""

    kind: str
    text: str

    def describe(self) -> str:
        return {"json_schema": "JSON Schema", "regex": "regular expression"}.get(self.kind, "grammar")

    def record(self) -> dict:
        """As a --jsonl record's fields give it (format_from_record's inverse)."""
        if self.kind == "json_schema":
            return {"json_schema": json.loads(self.text)}
        if self.kind == "regex":
            return {"regex": self.text}
        return {"grammar": self.text, "grammar_syntax": {"grammar": "auto"}.get(self.kind, self.kind)}


def json_schema_format(schema: object, source: str = "the JSON Schema") -> Format:
    """A JSON Schema given as a parsed value (an object, or true for any JSON value) or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InputError(f"{source} is not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InputError(f"{source} must be a JSON object (or true), not {type(schema).__name__}")
    if schema is False:
        raise InputError(f"{source} is false: no text can match it")
    try:
        return Format("json_schema", json.dumps({} if schema is True else normalized(schema)[0]))
    except RecursionError:
        raise InputError(f"{source} nests too deeply") from None


def grammar_format(text: str, syntax: str = "auto", source: str = "the grammar") -> Format:
    """A grammar's text: syntax "gbnf", "lark", or "auto" (Lark where it reads as Lark, else GBNF)."""
    if syntax not in GRAMMAR_SYNTAXES:
        raise InputError(f"the grammar syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, got {syntax!r}")
    if not text.strip():
        raise InputError(f"{source} is empty")
    return Format({"auto": "grammar"}.get(syntax, syntax), text)


def syntax_of_file(path: Path, syntax: str = "auto") -> str:
    """A grammar file's syntax: as given, else by its suffix (.gbnf, .lark), else told from its text."""
    if syntax != "auto":
        return syntax
    return {".gbnf": "gbnf", ".lark": "lark"}.get(path.suffix.lower(), "auto")


def format_from_record(record: dict) -> Format | None:
    """A --jsonl record's or a batch row's own constraint: its `json_schema`, `grammar` (with `grammar_syntax`) or
    `regex` field, at most one of them."""
    given = [name for name in ("json_schema", "grammar", "regex") if record.get(name) is not None]
    if len(given) > 1:
        raise InputError(f"give one of json_schema, grammar and regex, not {' and '.join(given)}")
    if record.get("grammar_syntax") is not None and given != ["grammar"]:
        raise InputError("grammar_syntax needs a grammar")
    if not given:
        return None
    value = record[given[0]]
    if given[0] == "json_schema":
        return json_schema_format(value, "json_schema")
    if not isinstance(value, str):
        raise InputError(f"{given[0]} must be a string, not {type(value).__name__}")
    if given[0] == "regex":
        return Format("regex", value)
    syntax = record.get("grammar_syntax", "auto")
    if not isinstance(syntax, str):
        raise InputError("grammar_syntax must be a string")
    return grammar_format(value, syntax, "grammar")


def require_llguidance():
    """The llguidance module, or MissingDependencyError saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise MissingDependencyError(f"structured outputs need llguidance: {INSTALL}") from None
    return llguidance


class Vocabulary:
    """A checkpoint's vocabulary as llguidance sees it, built once per model (about 0.1 s for 49,152 tokens).

    Ordinary tokens are their bytes. Special tokens (<|im_start|>) are marked as llguidance's special ones (a 0xFF
    byte first): no text in a grammar or schema can produce them, only a grammar's <name> or <[id]>. Ids with no
    token (holes in a tiktoken vocabulary) are special too, under a name no grammar writes, so they are never
    allowed. End-of-text is the token a constrained text ends with once its grammar accepts. Its constraints are
    compiled by its Compilers, in worker processes (constraint_worker.py)."""

    def __init__(self, encoding, eot: int | None) -> None:
        if eot is None:
            raise InputError(
                "a constrained text ends with end-of-text, and this model's vocabulary has none: structured "
                "outputs need a model with an end-of-text token"
            )
        require_llguidance()
        self.encoding, self.eot, self.size = encoding, eot, vocabulary_size(encoding)
        special = {encoding.encode_single_token(token) for token in encoding.special_tokens_set}
        known = decodable(encoding)
        holes = [i for i, has_token in enumerate(known) if not has_token]
        tokens = [_token_bytes(encoding, i, has_token, i in special) for i, has_token in enumerate(known)]
        marked = sorted(special) + holes
        self.tokenizer = llg_tokenizer(Tokens(tokens, eot, marked, partial(encode_text, encoding)), self.size)
        self.compilers = Compilers({"tokens": [token.hex() for token in tokens], "ends": [eot, marked]})


def _token_bytes(encoding, token: int, has_token: bool, special: bool) -> bytes:
    """A token as llguidance reads it: its bytes; a special token's after 0xFF (llguidance's mark); an id without a
    token as a special one no grammar names."""
    if not has_token:
        return b"\xff<|manas no token %d|>" % token
    return (b"\xff" if special else b"") + encoding.decode_single_token_bytes(token)


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: llguidance's grammar for one vocabulary. matcher() is each row's parser state."""

    vocabulary: Vocabulary
    grammar: str
    format: Format

    def matcher(self):
        llguidance, vocabulary = require_llguidance(), self.vocabulary
        return llguidance.LLMatcher(vocabulary.tokenizer, self.grammar, log_level=0, limits=limits())


def compile_format(format: Format, vocabulary: Vocabulary, field: str = "") -> Grammar:
    """format compiled for the vocabulary; InputError saying why (named after `field` where given) when llguidance
    cannot compile it: a schema keyword it does not implement, a grammar that does not parse, a regular expression
    out of its syntax, a grammar over its size limits, one no text can match, or one whose compile runs past the
    worker's time or memory (constraint_worker.py)."""
    name = field or f"the {format.describe()}"
    if len(format.text.encode("utf-8")) > MAX_FORMAT_BYTES:
        raise InputError(f"{name} has {len(format.text.encode('utf-8')):,} bytes: at most {MAX_FORMAT_BYTES:,}")
    try:
        grammar = vocabulary.compilers.compile(format.kind, format.text)
    except InputError as exc:
        raise InputError(f"{name} cannot be compiled: {_explained(format, str(exc))}") from None
    return Grammar(vocabulary, grammar, format)


def _explained(format: Format, reason: str) -> str:
    """llguidance's reason, or, for a oneOf it cannot take, which one and what manas takes."""
    if format.kind != "json_schema" or "oneOf constraints are not supported" not in reason:
        return reason
    where = normalized(json.loads(format.text))[1]
    return (
        f"{where or 'a oneOf'} may both match one value: manas takes a oneOf whose branches exclude each other "
        "(different types, const or enum values, a property one requires and another forbids, or a required "
        "property whose values differ); anyOf takes any of its branches"
    )
