"""The records manas writes, one JSON object a line: a generation's (generate --json, --jsonl, batch generate) and a
text's score (score --json, batch score). Built here, in the library, so that the CLI, the server and the Ray Data
classes write the same fields and the same bytes."""

from __future__ import annotations

import json
from collections.abc import Callable

from .engine.engines import Engine
from .errors import InputError
from .settings import GenerationSettings

# Legal raw inside a JSON string, but line ends to str.splitlines() and other splitters: escaped, so that a record
# with such a character in its text is still one line. (json.dumps already escapes every C0 control character.)
LINE_SEPARATORS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def json_line(record: dict) -> str:
    """One JSON object on one line for any line splitter; the text stays readable UTF-8 otherwise."""
    return json.dumps(record, ensure_ascii=False).translate(LINE_SEPARATORS)


def sample_record(stream, stats, storage: dict, seed: int, engine: Engine, settings: GenerationSettings) -> dict:
    """One --json line: the contract fields first, extras after. What reproduces it: the seed, the settings, the
    engine and, on the native one, the core's arithmetic version."""
    record = {
        "text": stream.text,
        "tokens": stream.tokens,
        "finish_reason": stream.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": len(stream.tokens),
        "ttft_s": stats.ttft_s,
        "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "re_prefills": stats.re_prefills,
        "cache": storage,
        "seed": seed,
        "weights": engine.weights,
        "engine": engine.name,
        "arithmetic_version": engine.arithmetic_version,
        **settings.record(),
    }
    if settings.logprobs:
        record["logprobs"] = stream.logprobs
    return record


def checked_stride(stride: int | None, block_size: int) -> int:
    """The scoring stride: half the window by default; ValueError outside 1..block_size."""
    stride = block_size // 2 if stride is None else stride
    if not 1 <= stride <= block_size:
        raise ValueError(f"{stride} is not in the range 1 <= stride <= {block_size} (the model's block_size)")
    return stride


def scored_ids(checkpoint, text: str) -> list[int]:
    """The text's token ids for score_record; InputError for a text of fewer than 2 tokens."""
    from .formats.tokenizer import encode_long_text

    ids = encode_long_text(checkpoint.encoding, text)
    if len(ids) < 2:
        raise InputError(f"the text is {len(ids)} token long: scoring needs at least 2")
    return ids


def score_record(
    checkpoint,
    engine: Engine,
    ids: list[int],
    characters: int,
    stride: int,
    on_window: Callable[[int], None] = lambda tokens: None,
) -> dict:
    """score --json's record for a text of `characters` characters (its scored_ids), scored in windows `stride`
    tokens apart (checked_stride's)."""
    from .engine.scoring import score

    result = score(engine, ids, characters, stride, on_window=on_window)
    return {
        "nats_per_token": result.nats_per_token,
        "nats_per_char": result.nats_per_char,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        "characters": result.characters,
        "stride": stride,
        "block_size": checkpoint.model.config.block_size,
        "checkpoint": str(checkpoint.path),
        "weights": engine.weights,
        "engine": engine.name,
    }
