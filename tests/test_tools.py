"""Structured outputs and tool calls on a live `manas serve` (issue 59), on a model with SmolLM2's real vocabulary
and real chat templates (Qwen2.5's, Llama 3.2's, Hermes 2 Pro's): response_format as OpenAI defines it and
llama-server's json_schema and grammar fields; tools with every tool_choice, answered as message.tool_calls whose
arguments validate under their function's schema, streamed as tool-call deltas; the round trip (call, tool result)
rendered as transformers renders it; and the clients people use: the openai client's parse helper with a pydantic
model, LangChain's with_structured_output and bind_tools, and `llm --schema`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from typing import Literal

import pytest

from cli_fixtures import DATA, MANAS, RUN_OPTIONS, cli_env, manas
from test_serve import running_server

openai = pytest.importorskip("openai")
pytest.importorskip("jinja2")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

TEMPLATES = DATA / "templates"  # data/SOURCES.md
QWEN = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
LLAMA = TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja"
HERMES = TEMPLATES / "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2[1], "--batch-size", "4", "--chat-template", str(QWEN)) as live:
        yield live


def called(choice) -> list[tuple[str, dict]]:
    """A choice's calls, each arguments validated under its function's schema."""
    calls = [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


def test_required_tool_calls_are_valid_calls_of_the_declared_functions(server):
    done = server.client().chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, n=4, seed=1
    )
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert called(choice) and all(call.id.startswith("call_") for call in choice.message.tool_calls)


def test_a_named_function_is_the_one_called_once_when_parallel_calls_are_off(server):
    done = server.client().chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=120,
        seed=2,
    )
    [(name, _)] = called(done.choices[0])
    assert name == "get_time"


def test_streamed_tool_call_deltas_add_up_to_the_answers_calls(server):
    options = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, seed=3)
    whole = server.client().chat.completions.create(**options)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in server.client().chat.completions.create(**options, stream=True):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.choices[0].message.tool_calls
    ]
    assert [calls[index] for index in sorted(calls)] == expected and finish == "tool_calls"


def test_tool_choice_none_and_auto_may_answer_in_text(server):
    for choice in ("none", "auto"):
        done = server.client().chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=8, seed=4
        )
        message = done.choices[0].message
        if choice == "none":  # the tools are shown, never called
            assert message.tool_calls is None and isinstance(message.content, str)
        else:
            assert message.tool_calls or message.content


@pytest.mark.parametrize("template", [QWEN, LLAMA, HERMES], ids=["qwen2.5", "llama3.2", "hermes2pro"])
def test_a_tool_round_trip_renders_the_ids_transformers_gives(smollm2, template):
    from transformers import AutoTokenizer

    from manas_cli.chat import parse_messages, render_prompt
    from manas_cli.formats.checkpoint import load_checkpoint

    folder, model = smollm2
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    as_transformers_takes = [
        *messages[:1],
        {**messages[1], "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        messages[2],
    ]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # bos_token as manas renders it for this vocabulary (SmolLM2 adds no BOS; Llama's and Hermes' templates write it)
    expected = tokenizer.apply_chat_template(
        as_transformers_takes, tools=TOOLS, chat_template=template.read_text(), add_generation_prompt=True,
        tokenize=True, return_dict=True, bos_token="",
    )["input_ids"]  # fmt: skip
    encoding = load_checkpoint(model).encoding
    assert render_prompt(template.read_text(), parse_messages(messages), encoding, TOOLS).ids == expected


def test_llama3_calls_are_its_json_object_with_parameters(smollm2):
    with running_server(smollm2[1], "--chat-template", str(LLAMA)) as live:
        done = live.client().chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, seed=5
        )
    assert done.choices[0].finish_reason == "tool_calls" and len(called(done.choices[0])) == 1


def nested_schema(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def post(server, body: dict, path: str = "/chat/completions") -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_completions_take_a_structured_output_too(server, smollm2):
    status, body = post(server, {"prompt": "Yes or no?", "regex": "(yes|no)!", "max_tokens": 10}, "/completions")
    assert status == 400 and body["error"]["param"] == "regex"  # llama-server's fields are json_schema and grammar
    status, body = post(server, {"prompt": "Yes or no?", "grammar": 'root ::= ("yes" | "no") "!"'}, "/completions")
    assert status == 200 and body["choices"][0]["text"] in ("yes!", "no!"), body
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    done = server.client().completions.create(
        model="m", prompt="JSON:", max_tokens=30, seed=1,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(done.choices[0].text), schema)
    alone = manas(
        "generate", "-c", smollm2[1], *RUN_OPTIONS, "-p", "JSON:", "-n", "30", "-s", "1", "--json-schema",
        json.dumps(schema), "--json",
    ).ok().json()  # fmt: skip
    assert done.choices[0].text == alone["text"]  # a seeded constrained answer is generate's


def test_response_format_and_llama_servers_fields_constrain_the_answer(server):
    person = {
        "type": "object",
        "properties": {"name": {"enum": ["Ann", "Bo"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    asks = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": person, "strict": True},
            }
        },
        {"json_schema": person},
        {"response_format": {"type": "json_object"}, "max_tokens": 400},
        {"grammar": 'root ::= ("yes" | "no") "!"'},
    ]
    for ask in asks:
        status, body = post(server, {"messages": ASK, "seed": 6, "max_tokens": 60, **ask})
        assert status == 200, body
        text, finish = body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]
        if "grammar" in ask:
            assert text in ("yes!", "no!") and finish == "stop"
        elif finish == "stop":
            value = json.loads(text)
            assert isinstance(value, dict)
            if "json_object" not in json.dumps(ask):
                jsonschema.validate(value, person)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
         "response_format", "cannot be compiled"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format must be an object whose type"),
        ({"json_schema": {"type": "integer", "minimum": 3, "maximum": 1}}, "json_schema", "Unsatisfiable"),
        ({"grammar": 'root ::= "a'}, "grammar", "cannot be compiled"),
        ({"json_schema": {}, "grammar": "root ::= 'a'"}, "grammar", "give one of"),
        ({"json_schema": nested_schema(300)}, "json_schema", "recursion limit"),  # deeper than Python's recursion
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no"}}}, "tool_choice", "not among"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "give tools or"),
    ],
)  # fmt: skip
def test_a_constraint_the_server_cannot_use_is_a_400_naming_its_field(server, body, param, message):
    status, answer = post(server, {"messages": ASK, **body})
    assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], answer


def test_a_model_whose_template_takes_no_tools_refuses_them_naming_tools(smollm2):
    with running_server(smollm2[1]) as live:  # SmolLM2-135M-Instruct's own template: no tools
        status, answer = post(live, {"messages": ASK, "tools": TOOLS})
    assert status == 400 and answer["error"]["param"] == "tools" and "takes no tools" in answer["error"]["message"]


# ---- the clients people use ----


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode needs
    name: Literal["Ann", "Bo"]
    age: int = pydantic.Field(ge=0, le=99)


def test_the_openai_clients_parse_helper_gets_a_pydantic_object(server):
    client = server.client()
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    done = parse(model="m", messages=ASK, response_format=Person, max_tokens=60, seed=7)
    assert isinstance(done.choices[0].message.parsed, Person)


def test_langchain_structured_output_and_bound_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        base_url=server.url, api_key="none", model="m", max_tokens=80, seed=8, max_retries=0
    )
    assert isinstance(model.with_structured_output(Person).invoke("Who?"), Person)
    answer = model.bind_tools(TOOLS, tool_choice="required").invoke("Weather in Paris?")
    assert answer.tool_calls
    for call in answer.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])


def test_llm_schema_answers_json_valid_under_it(server, tmp_path):
    if shutil.which("llm", path=os.path.dirname(MANAS[0])) is None:
        pytest.skip("llm is not installed")
    models = [{"model_id": "manas", "model_name": "m", "api_base": server.url, "supports_schema": True}]
    (tmp_path / "extra-openai-models.yaml").write_text(json.dumps(models))  # YAML is a superset of JSON
    llm = os.path.join(os.path.dirname(MANAS[0]), "llm")
    schema = json.dumps(Person.model_json_schema())
    done = subprocess.run(
        [llm, "-m", "manas", "--schema", schema, "-o", "seed", "9", "-o", "max_tokens", "80", "Invent a person"],
        capture_output=True, text=True, timeout=120,
        env={**cli_env(), "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "none"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    Person.model_validate_json(done.stdout)
