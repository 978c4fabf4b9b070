"""Issue 59's goals for structured outputs, on the shipped model and a SmolLM2-135M-shaped model (random weights of
the real shape from transformers' LlamaConfig, with SmolLM2's real 49,152-token tokenizer from tests/data).

  valid: 200 JSON Schemas of varied features (objects, arrays, enums, anyOf, $ref, patterns, numeric bounds,
         additionalProperties: false), generated from a fixed seed, each sampled at temperature 1: every answer
         that ends with end-of-text must validate with the jsonschema package; the share that runs out of tokens
         ("length") is reported, and every schema llguidance refuses, with its reason.
  cheap: decode tokens/s with a JSON Schema against without one on the SmolLM2 shape, 1 and 2 threads, the
         variants interleaved (medians).
  tools: 100 requests with tool_choice "required" to a live `manas serve` (Qwen2.5's real template): every call's
         arguments parse and validate under its function's schema.

    python benchmarks/goal_structured.py --goal valid --goal cheap --goal tools --runs 3
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from goal_llama_family import SHAPES
from harness import DATA, run_goals
from manas_cli.engine.generation import GenerationStats, generate
from manas_cli.errors import InputError
from manas_cli.models import ModelOptions, open_model
from manas_cli.requests import Requests, encode_prompt
from manas_cli.settings import GenerationSettings
from manas_cli.structured import json_schema_format

SMOLLM2_SHAPE = {**SHAPES["smollm2-135m"][1], "vocab_size": 49152}  # the real vocabulary, not GPT-2's
PROMPT = "Answer in JSON.\n"
SCHEMAS = 200


def smollm2_checkpoint(folder: Path) -> Path:
    """A SmolLM2-135M-shaped random model with SmolLM2's real tokenizer, converted by manas."""
    import transformers

    from manas_cli.formats.convert import convert_checkpoint

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMOLLM2_SHAPE))
    hf = folder / "smollm2-135m"
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DATA / "smollm2" / name, hf / name)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))  # <|im_end|>
    out = folder / "smollm2-135m.safetensors"
    convert_checkpoint(hf, out)
    return out


# ---- the schemas: varied features, from a fixed seed ----


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "enum", "integer", "number", "boolean", "pattern", "const", "null", "format"])
    return {
        "string": lambda: {"type": "string", "maxLength": rng.choice([4, 8, 16, 64])},
        "enum": lambda: {"enum": rng.sample(["red", "green", "blue", "amber", 1, 2.5, None, True], rng.randint(2, 4))},
        "integer": lambda: {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 1000)},
        "number": lambda: {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6},
        "boolean": lambda: {"type": "boolean"},
        "pattern": lambda: {"type": "string", "pattern": rng.choice([r"^[A-Z]{2}-[0-9]{3}$", r"^[a-z]+@[a-z]+\.org$"])},
        "const": lambda: {"const": rng.choice(["v1", 42, False])},
        "null": lambda: {"type": "null"},
        "format": lambda: {"type": "string", "format": rng.choice(["date", "email", "uuid", "date-time"])},
    }[kind]()


def node(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth >= 2 or roll < 0.45:
        return leaf(rng)
    if roll < 0.65:
        return {"type": "array", "items": node(rng, depth + 1), "minItems": rng.randint(0, 1), "maxItems": 3}
    if roll < 0.8:
        return {"anyOf": [node(rng, depth + 1), node(rng, depth + 1)]}
    return obj(rng, depth + 1)


def obj(rng: random.Random, depth: int) -> dict:
    names = rng.sample(
        ["id", "name", "tags", "score", "owner", "items", "kind", "ok", "meta", "when"], rng.randint(1, 4)
    )
    schema = {"type": "object", "properties": {name: node(rng, depth) for name in names}}
    schema["required"] = [name for name in names if rng.random() < 0.7]
    if rng.random() < 0.6:
        schema["additionalProperties"] = False
    return schema


def schemas(count: int, seed: int = 59) -> list[dict]:
    rng, made = random.Random(seed), []
    for i in range(count):
        schema = obj(rng, 0)
        if i % 5 == 0:  # a $ref into $defs
            schema = {"$defs": {"part": schema}, "type": "object", "properties": {"part": {"$ref": "#/$defs/part"}},
                      "required": ["part"], "additionalProperties": False}  # fmt: skip
        if i % 17 == 0:  # one llguidance cannot satisfy: counted as refused, with its reason
            schema = {"type": "integer", "minimum": 10, "maximum": 1}
        made.append(schema)
    return made


def valid_answers(checkpoint, engine, max_tokens: int) -> dict:
    import jsonschema

    requests = Requests(engine, checkpoint.encoding)
    ids = encode_prompt(checkpoint, PROMPT)
    counts = {"schemas": 0, "end_of_text": 0, "valid": 0, "length": 0}
    refused, invalid = [], []
    for index, schema in enumerate(schemas(SCHEMAS)):
        counts["schemas"] += 1
        settings = GenerationSettings(
            max_tokens=max_tokens, temperature=1.0, seed=index, format=json_schema_format(schema)
        )
        try:
            request = requests.prepare(settings, record=True)
        except InputError as exc:
            refused.append({"schema": index, "reason": str(exc)})
            continue
        stream = request.streams[0]
        for step in generate(engine, [ids], request.sampler, max_tokens, requests.eot):
            stream.feed(step.tokens[0])
            if stream.finished:
                break
        stream.finish("length")
        if stream.finish_reason == "end_of_text":
            counts["end_of_text"] += 1
            try:
                jsonschema.validate(json.loads(stream.text), schema)
                counts["valid"] += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                invalid.append({"schema": index, "text": stream.text, "why": str(exc)[:200]})
        else:
            counts["length"] += 1
    compiled = counts["schemas"] - len(refused)
    return {
        **counts,
        "valid_share_of_ended": counts["valid"] / max(1, counts["end_of_text"]),
        "length_share": counts["length"] / max(1, compiled),
        "refused": refused,
        "invalid": invalid,
    }


def models(folder: Path, threads: int):
    yield "shipped", open_model(ModelOptions(None, "cpu", "float32", threads, engine="native"))
    yield (
        "smollm2-135m",
        open_model(ModelOptions(smollm2_checkpoint(folder), "cpu", "float32", threads, engine="native")),
    )


def goal_valid(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        return {
            name: valid_answers(loaded.checkpoint, loaded.opened.engine, max_tokens=96)
            for name, loaded in models(Path(folder), args.threads)
        }


SPEECH = {"type": "object", "properties": {"speech": {"type": "string"}}, "required": ["speech"]}  # never closes


def decode_rate(checkpoint, engine, settings: GenerationSettings) -> float:
    requests = Requests(engine, checkpoint.encoding)
    request = requests.prepare(settings)
    stats = GenerationStats(prompt_tokens=1)
    for step in generate(engine, [encode_prompt(checkpoint, PROMPT)], request.sampler, settings.max_tokens, None):
        stats.update(step)
    return stats.decode_tokens_per_s


def goal_cheap(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = smollm2_checkpoint(Path(folder))
        for threads in (1, 2):
            loaded = open_model(ModelOptions(checkpoint, "cpu", "float32", threads, engine="native"))
            plain = GenerationSettings(max_tokens=128, temperature=1.0, seed=1)
            constrained = GenerationSettings(**{**plain.__dict__, "format": json_schema_format(SPEECH)})
            rates = {"plain": [], "json_schema": []}
            for _ in range(args.runs + 1):  # the first round warms up
                for name, settings in (("plain", plain), ("json_schema", constrained)):
                    rates[name].append(decode_rate(loaded.checkpoint, loaded.opened.engine, settings))
            medians = {name: statistics.median(values[1:]) for name, values in rates.items()}
            results[f"threads_{threads}"] = {**medians, "ratio": medians["json_schema"] / medians["plain"]}
    return results


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


def goal_tools(args) -> dict:
    """100 requests with tool_choice "required" to a live `manas serve` (Qwen2.5's template, the SmolLM2 shape),
    half with parallel calls: every call's arguments must parse and validate under its function's schema (a call
    that does not raises here)."""
    import subprocess
    import sys

    import jsonschema
    import openai

    schemas = {"get_weather": WEATHER, "get_time": TIME}
    counts = {"requests": 0, "tool_calls_finish": 0, "calls": 0, "valid_calls": 0, "length": 0}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = smollm2_checkpoint(Path(folder))
        template = DATA / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
        command = [sys.executable, "-m", "manas_cli", "serve", "-c", str(checkpoint), "--port", "8791",
                   "--chat-template", str(template), "--threads", str(args.threads)]  # fmt: skip
        server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        try:
            while "manas serve:" not in server.stderr.readline():
                pass
            client = openai.OpenAI(base_url="http://127.0.0.1:8791/v1", api_key="none")
            for seed in range(100):
                done = client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
                    tool_choice="required", parallel_tool_calls=seed % 2 == 0, max_tokens=200, temperature=1.0,
                    seed=seed,
                )  # fmt: skip
                choice = done.choices[0]
                counts["requests"] += 1
                counts["length"] += choice.finish_reason == "length"
                counts["tool_calls_finish"] += choice.finish_reason == "tool_calls"
                for call in choice.message.tool_calls or []:
                    counts["calls"] += 1
                    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                    counts["valid_calls"] += 1
        finally:
            server.terminate()
            server.wait()
    return counts


GOALS = {"valid": goal_valid, "cheap": goal_cheap, "tools": goal_tools}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
