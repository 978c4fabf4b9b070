"""manas in Ray Data: callable classes for `Dataset.map_batches` that load a model once per actor and turn a batch
of rows into records, the same records `manas generate --jsonl` and `manas score --json` write (docs/scale.md):

    import ray
    from manas_cli.ray_data import Generator

    prompts = ray.data.read_json("prompts.jsonl")  # columns: prompt, and any of id, seed, temperature, ...
    records = prompts.map_batches(
        Generator,
        fn_constructor_kwargs={"model": "smollm2-135m-instruct", "max_tokens": 64, "temperature": 0},
        batch_size=256,
        compute=ray.data.ActorPoolStrategy(size=4),
    )
    for row in records.iter_rows():
        print(row["record"])  # one --jsonl record, as JSON text

A row is a request either as columns (`prompt`, optionally `id` and any setting by its name; a missing value, None
or NaN, is the default) or as one `request` column holding a --jsonl line's text; an optional `line` column numbers
it (an error record names it, and a record's `id` defaults to it, as in --jsonl; without it, `id` defaults to null
and `line` is the row's place in its batch). Out come the columns `record` (the record's JSON text: its fields
vary, an error record's from a sample's, so one text column keeps every block's schema the same), `failed`
(whether it is an error record) and `line`.

Ray itself is not imported here: these are plain classes Ray instantiates in its actors (extra `ray`)."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

from .batch import RawLine, generate_records, score_line
from .models import ModelOptions, open_model
from .records import json_line
from .settings import GenerationSettings, with_overrides


def assigned_cpus() -> int:
    """The CPUs Ray gave this actor (its num_cpus), the core's thread count: more would take other actors' cores."""
    try:
        import ray

        return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    except (ImportError, RuntimeError):  # not inside Ray (a test, a plain call): one thread, as one actor has
        return 1


# The columns that hold integers. Arrow hands an integer column with a missing value to numpy as floats (NaN for
# the missing one), so a whole float there is taken back as the integer it was (exactly, up to 2^53).
INTEGERS = {field.name for field in fields(GenerationSettings) if field.type in ("int", "int | None")} | {
    "id",
    "line",
    "stride",
}


def plain(name: str, value: object) -> object:
    """A batch's cell as JSON takes it: numpy scalars and arrays as Python's; None for a missing one (NaN)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and name in INTEGERS and value.is_integer():
        return int(value)
    return value


def batch_rows(batch) -> list[dict]:
    """A batch (a dict of columns, or a pandas DataFrame) as rows of plain values."""
    columns = {name: list(batch[name]) for name in batch}
    count = len(next(iter(columns.values()), []))
    return [{name: plain(name, cells[index]) for name, cells in columns.items()} for index in range(count)]


def raw_line(row: dict, place: int) -> RawLine:
    """A row as the line --jsonl would read: a `request` column's text as it is, the other columns as one JSON
    object of the values given; `unreadable` (from `manas batch`: why a line is not UTF-8, or too long) passes
    through."""
    number = row.pop("line", None)
    numbered = number is not None
    number = int(number) if numbered else place
    if row.get("unreadable") is not None:
        return RawLine(number, None, row["unreadable"])
    if "request" in row:
        return RawLine(number, row["request"])
    given = {name: value for name, value in row.items() if value is not None}
    return RawLine(number, json.dumps(given if numbered or "id" in given else {"id": None, **given}))


def output(records: list[dict], lines: list[RawLine]) -> dict:
    return {
        "record": [json_line(record) for record in records],
        "failed": ["error" in record for record in records],
        "line": [line.number for line in lines],
    }


def open_for_actor(
    model: str | Path | None,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    engine: str = "auto",
    quantize: str | None = None,
    float_activations: bool = False,
    ctx: int | None = None,
):
    """(checkpoint, engine) of a model opened once per actor: a path every node can read, or a store name (`manas
    pull` on each node); the model flags as the library takes them (models.ModelOptions)."""
    options = ModelOptions(
        checkpoint=None if model is None else Path(model),
        device=device,
        dtype=dtype,
        threads=threads or assigned_cpus(),
        engine=engine,
        quantize=quantize,
        float_activations=float_activations,
        ctx=ctx,
    )
    loaded = open_model(options)
    return loaded.checkpoint, loaded.engine


MODEL_KEYS = ("device", "dtype", "threads", "engine", "quantize", "float_activations", "ctx")  # open_for_actor's


class Generator:
    """Requests in, generate --jsonl's records out, decoded `batch_size` rows at a time by continuous batching.
    Keyword arguments: open_for_actor's (device, dtype, threads, engine, quantize, float_activations, ctx), and
    the settings' defaults (max_tokens, temperature, seed, stop, ...), checked as --jsonl checks a line's."""

    def __init__(self, model: str | Path | None = None, *, batch_size: int = 16, overflow: str = "recompute", **keys):
        settings = {name: value for name, value in keys.items() if name not in MODEL_KEYS}
        self.defaults = with_overrides(GenerationSettings(), settings)
        self.batch_size, self.overflow = batch_size, overflow
        self.checkpoint, self.engine = open_for_actor(
            model, **{name: keys[name] for name in MODEL_KEYS if name in keys}
        )

    def __call__(self, batch) -> dict:
        lines = [raw_line(row, place) for place, row in enumerate(batch_rows(batch), 1)]
        records = generate_records(self.checkpoint, self.engine, lines, self.defaults, self.batch_size, self.overflow)
        return output(records, lines)


class Scorer:
    """Texts in (a `text` column, optionally `id` and `stride`; or `request` lines), score --json's records out,
    each with its `id`. Keyword arguments: open_for_actor's."""

    def __init__(self, model: str | Path | None = None, *, stride: int | None = None, **model_keys):
        self.stride = stride
        self.checkpoint, self.engine = open_for_actor(model, **model_keys)

    def __call__(self, batch) -> dict:
        lines = [raw_line(row, place) for place, row in enumerate(batch_rows(batch), 1)]
        return output([score_line(self.checkpoint, self.engine, line, self.stride) for line in lines], lines)
