"""Hardening round 7 (issue 69), the server's part: a constraint's compile is bounded in time and memory and holds
no other request back; tool calls name declared functions only, with arguments valid under their schemas; a model
that repeats a call is not asking for two; response_format takes llama-server's schema and refuses unknown keys.

The tool-call tests run a model whose greedy answer is fixed: learned positions whose embedding at the prompt's
end and after it points at the next token of a scripted answer (blocks zeroed, so nothing else moves the residual),
with SmolLM2's real tokenizer and real chat templates, asked through the openai client."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from test_real_tokenizers import SMOLLM2
from test_serve import running_server
from test_tools import ASK, LLAMA, QWEN, TOOLS, post

openai = pytest.importorskip("openai")
pytest.importorskip("jinja2")
pytest.importorskip("llguidance")

UTC = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
HOSTILE_GBNF = "\n".join(["root ::= r0", *(f'r{i} ::= "x" r{i + 1} | "y"' for i in range(10_000)), 'r10000 ::= "z"'])
# the intersection of 60 "contains" languages: an automaton of up to 2^60 states
HOSTILE_SCHEMA = {"type": "string", "allOf": [{"pattern": f"x{i:02d}"} for i in range(60)]}


@pytest.fixture(scope="module")
def smollm2_spec() -> dict:
    """SmolLM2's real tokenizer as a converted checkpoint embeds it: the chat turn ends with <|im_end|>."""
    from manas_cli.formats.huggingface import folder_tokenizer

    return folder_tokenizer(SMOLLM2)[1]


def scripted_model(path: Path, spec: dict, template: Path, answer: str) -> Path:
    """A GPT-2-layout model with SmolLM2's tokenizer whose greedy answer to ASK with TOOLS, rendered by `template`,
    is `answer` then end-of-text."""
    from manas_cli.chat import parse_messages, render_prompt
    from manas_cli.engine.config import GPTConfig
    from manas_cli.formats.checkpoint import save_checkpoint
    from manas_cli.formats.tokenizer import build_encoding, encode_text, end_of_text_id
    from manas_cli.torch_engine.model import GPT

    encoding = build_encoding(spec)
    prompt = render_prompt(template.read_text(), parse_messages(ASK), encoding, TOOLS).ids
    script = [*encode_text(encoding, answer), end_of_text_id(encoding)]
    model = GPT(GPTConfig(vocab_size=49152, block_size=1024, n_layer=1, n_head=2, n_embd=128))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
        embedding = model.token_embedding.weight
        embedding.normal_(generator=torch.Generator().manual_seed(0))
        for k, token in enumerate(script):  # position p's output is the token at p + 1
            model.position_embedding.weight[len(prompt) - 1 + k] = 24 * embedding[token]
    save_checkpoint(path, model, spec)
    return path


@pytest.fixture
def scripted(tmp_path, smollm2_spec):
    def serve(template: Path, answer: str):
        path = scripted_model(tmp_path / "scripted.safetensors", smollm2_spec, template, answer)
        return running_server(path, "--chat-template", str(template))

    return serve


def ask(live, **options):
    return live.client().chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, **options
    )


def test_a_call_to_an_undeclared_function_in_free_text_is_never_a_tool_call(scripted):
    answer = ' ok <tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    with scripted(QWEN, answer) as live:
        none = ask(live, tool_choice="none").choices[0].message
        auto = ask(live, tool_choice="auto").choices[0]
    assert none.content == answer and none.tool_calls is None  # what the model writes unconstrained
    assert auto.message.tool_calls is None and auto.finish_reason == "stop"
    assert "<tool_call>" not in auto.message.content and auto.message.content.startswith(" ok <tool")


def test_llama3s_free_text_never_opens_with_a_call_after_whitespace(scripted):
    answer = ' {"name": "rm_rf", "parameters": {"path": "/"}}'
    with scripted(LLAMA, answer) as live:
        done = ask(live, tool_choice="auto").choices[0]
    assert done.message.tool_calls is None and not done.message.content.lstrip().startswith("{")


@pytest.mark.parametrize("parallel", [True, False])
def test_a_call_written_twice_is_one_call_for_every_tool_choice(scripted, parallel):
    answer = f"<tool_call>\n{UTC}\n</tool_call>\n<tool_call>\n{UTC}\n</tool_call>"
    named = {"type": "function", "function": {"name": "get_time"}}
    with scripted(QWEN, answer) as live:
        for choice in ("required", named, "auto"):
            done = ask(live, tool_choice=choice, parallel_tool_calls=parallel).choices[0]
            calls = [(call.function.name, json.loads(call.function.arguments)) for call in done.message.tool_calls]
            assert calls == [("get_time", {"zone": "UTC"})] and done.finish_reason == "tool_calls", choice
            assert done.message.content is None


def test_two_different_calls_are_two_and_a_call_may_end_after_its_newline(scripted):
    weather = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    answer = f"<tool_call>\n{UTC}\n</tool_call>\n<tool_call>\n{weather}\n</tool_call>\n"
    with scripted(QWEN, answer) as live:
        both = ask(live, tool_choice="required").choices[0].message.tool_calls
        one = ask(live, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls
    assert [call.function.name for call in both] == ["get_time", "get_weather"]
    assert [call.function.name for call in one] == ["get_time"]


def test_read_calls_checks_names_and_arguments_again():
    from manas_cli.tools import parse_tools, read_calls

    tools = parse_tools({"tools": TOOLS})
    good = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    bad_unit = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}'
    for text in (
        f"<tool_call>\n{bad_unit}\n</tool_call>",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        f"so: <tool_call>\n{good}\n</tool_call>",
        f"<tool_call>\n{good}\n</tool_call> and text",
        f'<tool_call>\n{good[:-1]}, "extra": 1}}\n</tool_call>',
    ):
        assert read_calls(text, "hermes", tools).calls == [] and read_calls(text, "hermes", tools).content == text
    assert len(read_calls(f"<tool_call>\n{good}\n</tool_call>\n", "hermes", tools).calls) == 1
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert read_calls(f"<tool_call>\n{good}\n</tool_call>", "hermes", named).calls == []
    backtracking = {"properties": {"a": {"pattern": "^(a+)+$"}}}
    pattern = [{"type": "function", "function": {"name": "f", "parameters": backtracking}}]
    evil = '{"name": "f", "parameters": {"a": "' + "a" * 40 + 'b"}}'
    assert read_calls(evil, "llama3", parse_tools({"tools": pattern})).calls == []  # bounded, not backtracking


@pytest.fixture(scope="module")
def server(smollm2_spec, tmp_path_factory):
    path = tmp_path_factory.mktemp("compiles") / "model.safetensors"
    scripted_model(path, smollm2_spec, QWEN, "fine")
    with running_server(path, "--batch-size", "4", "--chat-template", str(QWEN)) as live:
        yield live


def test_hostile_compiles_are_400s_and_hold_no_other_request_back(server):
    answers: dict[str, tuple[int, dict]] = {}

    def send(name: str, body: dict, path: str = "/chat/completions") -> None:
        answers[name] = post(server, {"messages": ASK, "max_tokens": 4, **body}, path)

    hostile = [
        threading.Thread(target=send, args=("grammar", {"grammar": HOSTILE_GBNF})),
        threading.Thread(target=send, args=("json_schema", {"json_schema": HOSTILE_SCHEMA})),
    ]
    for thread in hostile:
        thread.start()
    # while both compile (seconds), a plain request and a json_object one, not compiled before, answer
    send("plain", {})
    send("json_object", {"response_format": {"type": "json_object"}})
    assert any(thread.is_alive() for thread in hostile), "the hostile compiles ended before the others: no test"
    for thread in hostile:
        thread.join(timeout=60)
    assert answers["plain"][0] == 200 and answers["json_object"][0] == 200, answers
    for field in ("grammar", "json_schema"):
        status, body = answers[field]
        assert status == 400 and body["error"]["param"] == field, body
        assert "cannot be compiled" in body["error"]["message"] and "\n" not in body["error"]["message"]
    assert server.health()["status"] == "ok" and server.process.poll() is None


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "no text can match it"),
        ({"type": "string", "pattern": "^((a{100}){100}){100}$"}, "over llguidance's limits"),
    ],
    ids=["ref-cycle", "nested-repeats"],
)
def test_an_unsatisfiable_or_over_limit_schema_is_a_400_at_compile_time(server, schema, why):
    body = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    status, answer = post(server, {"messages": ASK, "response_format": body, "max_tokens": 4})
    assert status == 400 and answer["error"]["param"] == "response_format", answer
    assert why in answer["error"]["message"] and "\n" not in answer["error"]["message"], answer


def test_response_format_takes_llama_servers_schema_and_refuses_unknown_keys(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False
    body = {"messages": ASK, "response_format": {"type": "json_object", "schema": schema}, "temperature": 0}
    status, answer = post(server, body)
    assert status == 200 and json.loads(answer["choices"][0]["message"]["content"]).keys() == {"ok"}, answer
    for body in (
        {"type": "json_object", "schemas": schema},
        {"type": "text", "schema": schema},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}, "strict": True},
    ):
        status, answer = post(server, {"messages": ASK, "response_format": body, "max_tokens": 4})
        assert status == 400 and answer["error"]["param"] == "response_format", (body, answer)
        assert repr(sorted(set(body) - {"type", "json_schema"})[0]) in answer["error"]["message"]


def test_jsonl_sizes_its_rows_from_free_memory_on_a_long_window_model(tmp_path, tiny_bpe_spec):
    """An 8k-window model: 16 rows of its window need about 17 GiB; under a 4 GiB address space the default batch
    takes the rows that fit, says so, and gives batch size 1's records."""
    from cli_fixtures import RUN_OPTIONS, cli
    from manas_cli.engine.config import GPTConfig
    from manas_cli.formats.checkpoint import save_checkpoint
    from manas_cli.torch_engine.model import GPT

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=320, block_size=8192, n_layer=1, n_head=4, n_embd=32, position_encoding="rope")
    path = tmp_path / "long.safetensors"
    save_checkpoint(path, GPT(config), tiny_bpe_spec)
    lines = "".join(json.dumps({"prompt": f"the {word}", "seed": 1, "max_tokens": 8}) + "\n" for word in "abcdefgh")
    fitted = cli("generate", "-c", path, *RUN_OPTIONS, "--jsonl", stdin=lines, address_space=4 << 30, text=True)
    alone = cli("generate", "-c", path, *RUN_OPTIONS, "--jsonl", "--batch-size", "1", stdin=lines, text=True)
    assert fitted.returncode == 0 and alone.returncode == 0, fitted.stderr
    assert "notice: batch size" in fitted.stderr and "8,192-token window" in fitted.stderr, fitted.stderr
    assert [json.loads(line)["text"] for line in fitted.stdout.splitlines()] == [
        json.loads(line)["text"] for line in alone.stdout.splitlines()
    ]


def test_a_model_that_stops_calling_ends_its_answer_rather_than_being_pushed_into_another_call(scripted):
    answer = f"<tool_call>\n{UTC}\n</tool_call>\nI hope this helps."
    with scripted(QWEN, answer) as live:
        for choice in ("required", "auto"):
            done = ask(live, tool_choice=choice).choices[0]
            calls = [(call.function.name, json.loads(call.function.arguments)) for call in done.message.tool_calls]
            assert calls == [("get_time", {"zone": "UTC"})] and done.finish_reason == "tool_calls", choice
