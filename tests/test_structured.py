"""Structured outputs (issue 59): a JSON Schema, a grammar or a regular expression every text matches, through the
real CLI (--json-schema, --grammar, --regex; --jsonl's own fields), with every answer that ends validated by
`jsonschema` (a validator that is not the constraint's); and exactness kept: with a constraint, cached generation
equals crop-and-recompute past the window and batched rows equal each request alone, on both engines, float32,
int8 and int4."""

from __future__ import annotations

import json
import re

import pytest

from cli_fixtures import DATA, RUN_OPTIONS, checkpoints, manas  # noqa: F401 (checkpoints: a fixture)

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ROMEO", "JULIET", "MERCUTIO"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "lines"],
    "additionalProperties": False,
}
SPEECH = {"type": "object", "properties": {"speech": {"type": "string"}}, "required": ["speech"]}  # runs long


def run_generate(checkpoint, *flags: str, **env: str):
    return manas("generate", "-c", checkpoint.path, *RUN_OPTIONS, "-p", "ROMEO:", *flags, **env)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_answer_that_ends_is_valid_under_its_schema(checkpoints, seed):
    record = run_generate(
        checkpoints["rope-gqa"], "--json-schema", json.dumps(PERSON), "-n", "80", "--seed", str(seed), "--json"
    ).ok()
    answer = record.json()
    assert answer["finish_reason"] == "end_of_text", answer
    jsonschema.validate(json.loads(answer["text"]), PERSON)


def test_a_grammar_file_in_gbnf_or_lark_and_a_regex_constrain_the_text(checkpoints, tmp_path):
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") ", " [a-z]{2,5} "."\n')
    lark = tmp_path / "answer.lark"
    lark.write_text('start: ("yes" | "no") ", " /[a-z]{2,5}/ "."\n')
    shape = re.compile(r"(yes|no), [a-z]{2,5}\.")
    for flags in (("--grammar-file", gbnf), ("--grammar-file", lark), ("--grammar", gbnf.read_text())):
        answer = run_generate(checkpoints["learned-mha"], *flags, "--seed", "4", "--json").ok().json()
        assert shape.fullmatch(answer["text"]) and answer["finish_reason"] == "end_of_text", (flags, answer)
    answer = run_generate(checkpoints["learned-mha"], "--regex", r"[0-9]{3}-[A-Z]{2}", "-t", "0", "--json").ok().json()
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", answer["text"]) and answer["finish_reason"] == "end_of_text"


LLAMA_CPP_GRAMMARS = sorted((DATA / "llamacpp" / "grammars").glob("*.gbnf"))  # data/SOURCES.md


def test_llama_cpps_own_grammars_compile_and_constrain_the_text(checkpoints):
    """Every example grammar llama.cpp ships compiles and constrains generation (the library, in-process: the
    CLI's --grammar-file is tested above); a JSON one's finished answer parses."""
    from manas_cli.engine.generation import generate
    from manas_cli.requests import Requests
    from manas_cli.settings import GenerationSettings
    from manas_cli.structured import grammar_format

    checkpoint, runner = opened(checkpoints["rope-gqa"], "native", None)
    requests = Requests(runner, checkpoint.encoding)
    ids = checkpoint.encoding.encode_ordinary("ROMEO:")
    for path in LLAMA_CPP_GRAMMARS:
        settings = GenerationSettings(max_tokens=40, seed=2, format=grammar_format(path.read_text()))
        request = requests.prepare(settings)
        tokens = [step.tokens[0] for step in generate(runner, [ids], request.sampler, 40, requests.eot)]
        ended = tokens[-1] == requests.eot
        text = checkpoint.encoding.decode(tokens[:-1] if ended else tokens)
        if path.stem.startswith("json") and ended:
            json.loads(text)


def test_a_jsonl_records_own_constraint_gives_generates_answer_and_a_bad_one_is_that_lines_error(checkpoints):
    lines = [
        {"prompt": "ROMEO:", "seed": 5, "max_tokens": 80, "json_schema": PERSON},
        {"prompt": "ROMEO:", "seed": 5, "max_tokens": 20, "regex": "(yes|no)!"},
        {"prompt": "ROMEO:", "json_schema": {"type": "object", "properties": {"a": {"format": "no-such"}}}},
        {"prompt": "ROMEO:", "grammar": 'root ::= "a', "max_tokens": 3},
        {"prompt": "ROMEO:", "regex": "a", "grammar": "root ::= 'a'"},
    ]
    stdin = "".join(json.dumps(line) + "\n" for line in lines).encode()
    done = manas("generate", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "--jsonl", stdin=stdin)
    assert done.returncode == 1 and "3 of 5 lines failed" in done.err
    records = done.json_lines()
    alone = run_generate(checkpoints["rope-gqa"], "--json-schema", json.dumps(PERSON), "-n", "80", "-s", "5", "--json")
    assert records[0]["text"] == alone.ok().json()["text"]
    assert re.fullmatch(r"(yes|no)!", records[1]["text"])
    assert "cannot be compiled: Unknown format: no-such" in records[2]["error"]
    assert records[3]["error"].startswith("the grammar cannot be compiled")
    assert records[4]["error"] == "give one of json_schema, grammar and regex, not grammar and regex"


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--json-schema", "[1"), "the schema is not JSON"),
        (("--json-schema", "false"), "no text can match it"),
        (("--regex", "("), "the regular expression cannot be compiled"),
        (("--regex", "a", "--grammar", "root ::= 'a'"), "give one constraint, not --grammar and --regex"),
        (("--grammar-syntax", "lark"), "--grammar-syntax needs --grammar or --grammar-file"),
        (("--json-schema-file", "/no/such/schema.json"), "JSON Schema file /no/such/schema.json does not exist"),
        (("--json-schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "Unsatisfiable schema"),
        (("--json-schema", '{"$ref": "#/$defs/missing"}'), "Pointer '/$defs/missing' does not exist"),
        (("--json-schema", '{"not": {"type": "integer"}}'), 'Unimplemented keys: ["not"]'),
    ],
)  # fmt: skip
def test_a_constraint_that_cannot_be_used_is_one_error_line(checkpoints, flags, message):
    done = run_generate(checkpoints["learned-mha"], *flags)
    assert done.returncode in (1, 2) and message in done.err and "Traceback" not in done.err
    assert len(done.err.strip().splitlines()) == 1 and done.out == ""


def test_a_schema_file_over_a_mebibyte_is_refused_unread(checkpoints, tmp_path):
    schema = tmp_path / "huge.json"
    schema.write_text(json.dumps({"enum": ["x" * 1000] * 1100}))
    done = run_generate(checkpoints["learned-mha"], "--json-schema-file", schema)
    assert done.returncode == 2 and f"JSON Schema file {schema} is over 1 MiB" in done.err


def test_without_llguidance_the_flags_say_how_to_install_it(checkpoints, tmp_path):
    (tmp_path / "llguidance.py").write_text("raise ImportError('not installed here')\n")
    done = run_generate(checkpoints["learned-mha"], "--regex", "a", PYTHONPATH=str(tmp_path))
    assert (
        done.returncode == 1 and 'structured outputs need llguidance: pip install "manas-cli[structured]"' in done.err
    )


def test_chat_answers_every_message_under_the_schema(checkpoints, tmp_path):
    pytest.importorskip("jinja2")
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    done = manas(
        "chat", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "--chat-template", template, "--json",
        "--json-schema", json.dumps(PERSON), "-s", "3", stdin=b"Who are you?\nAnd now?\n",
    ).ok()  # fmt: skip
    answers = done.json_lines()
    assert len(answers) == 2
    for answer in answers:
        jsonschema.validate(json.loads(answer["text"]), PERSON)


# ---- exactness with a constraint: the library, on both engines ----


def opened(checkpoint, engine: str, quantize: str | None):
    from manas_cli.models import ModelOptions, open_model

    loaded = open_model(ModelOptions(checkpoint.path, "cpu", "float32", 1, quantize, engine=engine))
    assert loaded.opened.engine.name == engine
    return loaded.checkpoint, loaded.opened.engine


@pytest.mark.parametrize("engine", ["native", "torch"])
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_constrained_cached_generation_equals_crop_and_recompute_and_batched_equals_alone(
    checkpoints, engine, quantize
):
    from manas_cli.engine.batching import generate_batched
    from manas_cli.engine.generation import generate, generate_reference
    from manas_cli.requests import Requests
    from manas_cli.settings import GenerationSettings
    from manas_cli.structured import json_schema_format

    checkpoint, runner = opened(checkpoints["rope-gqa"], engine, quantize)
    requests = Requests(runner, checkpoint.encoding)
    settings = GenerationSettings(max_tokens=48, seed=9, format=json_schema_format(SPEECH))
    prompts = [checkpoint.encoding.encode_ordinary(text) for text in ("ROMEO:", "JULIET: O Romeo, Romeo!")]

    def tokens(steps) -> list[list[int]]:
        return [step.tokens for step in steps]

    for ids in prompts:  # 48 new tokens after the prompt: past the 32-token window
        cached = tokens(generate(runner, [ids, ids], requests.prepare(settings, 2).sampler, 48, requests.eot))
        reference = tokens(
            generate_reference(runner, [ids, ids], requests.prepare(settings, 2).sampler, 48, requests.eot)
        )
        assert cached == reference
        assert bytes(checkpoint.encoding.decode_bytes([row[0] for row in cached])).startswith(b'{"speech": "')

    alone = [
        [step.tokens[0] for step in generate(runner, [ids], requests.prepare(settings).sampler, 48, requests.eot)]
        for ids in prompts
    ]
    waiting = [requests.prepare(settings).request(key, ids) for key, ids in enumerate(prompts)]
    batched = {key: [] for key in range(len(prompts))}
    for step in generate_batched(runner, lambda wait: waiting.pop(0) if waiting else None, 4, requests.eot):
        for made in step:
            assert made.error is None
            batched[made.key].append(made.token)
    assert [batched[key] for key in range(len(prompts))] == alone


def test_the_readmes_grammar_example_runs_as_written():
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (example,) = re.findall(r"`(manas generate [^`]*--grammar[^`]*)`", readme)
    done = manas(*shlex.split(example)[1:], "--threads", "1").ok()
    assert done.out.strip() in ("yes.", "no.")


@pytest.mark.parametrize(
    "given",
    [("json_schema", {"type": "object"}), ("grammar", 'root ::= "a"'), ("regex", "a+")],
    ids=["json_schema", "grammar", "regex"],
)
def test_batchs_settings_reach_its_ray_actors_as_a_records_fields(given):
    """manas batch generate hands its flags' settings to the actors as a --jsonl record's keys (as_overrides), which
    the actors read back (with_overrides): the constraint survives the trip."""
    from manas_cli.settings import GenerationSettings, as_overrides, with_overrides
    from manas_cli.structured import format_from_record

    settings = GenerationSettings(max_tokens=5, format=format_from_record(dict([given])))
    keys = json.loads(json.dumps(as_overrides(settings)))  # as the job's options travel
    assert with_overrides(GenerationSettings(), keys) == settings


TAGGED = {
    "oneOf": [
        {
            "type": "object",
            "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["kind", "lives"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"kind": {"const": "dog"}, "name": {"type": "string", "maxLength": 6}},
            "required": ["kind", "name"],
            "additionalProperties": False,
        },
    ]
}
EXCLUSIVE = {
    "tagged union": TAGGED,
    "types": {"oneOf": [{"type": "integer"}, {"type": "array", "maxItems": 2.0, "items": {"type": "boolean"}}]},
    "enums": {"oneOf": [{"enum": [1, 2]}, {"enum": ["one", "two"]}]},
    "forbidden": {
        "type": "object",
        "properties": {"p": {"type": "integer"}, "q": {"type": "integer"}},
        "additionalProperties": False,
        "oneOf": [
            {"type": "object", "required": ["p"], "properties": {"q": False}},
            {"type": "object", "required": ["q"], "properties": {"p": False}},
        ],
    },
    "counts as floats": {"type": "string", "minLength": 2.0, "maxLength": 3.0},
}


@pytest.mark.parametrize("name", EXCLUSIVE)
def test_a_oneof_of_exclusive_branches_and_integer_valued_counts_are_taken(checkpoints, name):
    schema = EXCLUSIVE[name]
    ended = []
    for seed in (1, 2, 3):
        answer = run_generate(checkpoints["rope-gqa"], "--json-schema", json.dumps(schema), "-n", "60", "--seed",
                              str(seed), "--json").ok().json()  # fmt: skip
        if answer["finish_reason"] == "end_of_text":
            ended.append(json.loads(answer["text"]))
    assert ended, "no answer ended: nothing was validated"
    for value in ended:
        jsonschema.validate(value, schema)  # exactly one branch, as oneOf asks


def test_a_oneof_whose_branches_may_overlap_is_refused_naming_them(checkpoints):
    schema = {"properties": {"n": {"oneOf": [{"type": "integer"}, {"minimum": 2}]}}}
    done = run_generate(checkpoints["rope-gqa"], "--json-schema", json.dumps(schema))
    assert done.returncode == 1 and len(done.err.strip().splitlines()) == 1
    assert "#/properties/n/oneOf's branches 0 and 1 may both match one value" in done.err


def test_normalizing_never_rewrites_data_and_proves_only_what_holds():
    from manas_cli.schema_normal import excluded, normalized

    data = {"const": {"maxItems": 2.0}, "enum": [{"oneOf": []}], "maxItems": 2.0}
    assert normalized(data) == ({"const": {"maxItems": 2.0}, "enum": [{"oneOf": []}], "maxItems": 2}, None)
    assert not excluded({"type": "integer"}, {"type": "number"})  # integers are numbers
    assert not excluded({"const": 1}, {"enum": [1.0]}) and excluded({"const": True}, {"const": 1})
    assert not excluded({"required": ["a"]}, {"properties": {"a": False}})  # a non-object matches both
    assert excluded({"type": "object", "required": ["a"]}, {"type": "object", "properties": {"a": False}})
