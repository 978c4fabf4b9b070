"""Models that think before they answer (issue 71): SmolLM3's real chat template (thinking by default, an empty
thought closed by the template when enable_thinking is false) on a model with SmolLM2's real vocabulary. The server
returns the thought apart as reasoning_content, streamed as delta.reasoning_content, through the real openai client;
chat_template_kwargs reach the template; `manas chat --think/--no-think` passes enable_thinking; and a structured
output's grammar constrains only the reply after the thought."""

from __future__ import annotations

import json

import pytest

from cli_fixtures import DATA, RUN_OPTIONS, manas
from manas_cli import thinking
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.formats.tokenizer import encode_text
from test_serve import running_server

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

SMOLLM3 = DATA / "templates" / "HuggingFaceTB-SmolLM3-3B.jinja"  # data/SOURCES.md
ASK = [{"role": "user", "content": "What is two and two?"}]
# What the grammar field makes the random model write: a thought, then the reply
THOUGHT_THEN_REPLY = 'start: "<think>\\nTwo and two make four.\\n</think>\\n\\nFour."'


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2[1], "--batch-size", "4", "--chat-template", str(SMOLLM3)) as live:
        yield live


def rendered_ids(smollm2, messages: list[dict], **kwargs) -> list[int]:
    """The prompt's ids as transformers' apply_chat_template gives them for SmolLM3's template, kwargs passed to it
    (enable_thinking), with the folder's real tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2[0])
    return tokenizer.apply_chat_template(
        messages, chat_template=SMOLLM3.read_text(), add_generation_prompt=True, tokenize=True, return_dict=True,
        **kwargs,
    )["input_ids"]  # fmt: skip


TEXTS = [
    "<think>\nTwo and two make four.\n</think>\n\nFour.",
    "  <think>a</think>b",
    "<think>\n\n</think>\nNo thought.",
    "Hello <think>x</think> y",
    "<think>cut short, never closed",
    "<thi",
    "",
    "<think>one</think>two</think>three",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("state", [thinking.MAY_OPEN, thinking.INSIDE, thinking.NONE])
def test_a_streamed_answer_splits_as_the_whole_answer_does_in_pieces_of_any_size(text, state):
    whole = thinking.split(text, state)
    for size in (1, 2, 3, 7):
        splitter, thought, reply = thinking.ThoughtSplitter(state), "", ""
        for start in range(0, len(text), size):
            more_thought, more_reply = splitter.feed(text[start : start + size])
            thought, reply = thought + more_thought, reply + more_reply
        rest_thought, rest_reply = splitter.finish()
        assert (thought + rest_thought if splitter.thought else None, reply + rest_reply) == whole


def test_the_thought_and_the_reply_are_told_apart_where_the_answer_starts():
    answer = "<think>\nTwo and two make four.\n</think>\n\nFour."
    assert thinking.split(answer, thinking.MAY_OPEN) == ("Two and two make four.", "Four.")
    assert thinking.split("Four.", thinking.MAY_OPEN) == (None, "Four.")
    assert thinking.split("make four.</think>Four.", thinking.INSIDE) == ("make four.", "Four.")
    assert thinking.split("<think>still thinking", thinking.MAY_OPEN) == ("still thinking", "")
    assert thinking.split(answer, thinking.NONE) == (None, answer)  # thinking off: the text is the reply


def test_where_an_answer_starts_follows_the_rendered_prompt_of_smollm3s_template(smollm2):
    from manas_cli.chat import parse_messages, render_prompt

    template, encoding = SMOLLM3.read_text(), load_checkpoint(smollm2[1]).encoding
    thinks = render_prompt(template, parse_messages(ASK), encoding)
    assert thinks.ids == rendered_ids(smollm2, ASK) and thinks.thought == thinking.MAY_OPEN and thinks.thinks
    off = render_prompt(template, parse_messages(ASK), encoding, kwargs={"enable_thinking": False})
    assert off.ids == rendered_ids(smollm2, ASK, enable_thinking=False) and off.thought == thinking.NONE
    assert off.ids != thinks.ids
    system = [{"role": "system", "content": "Be brief. /no_think"}, *ASK]  # the template's own switch
    assert render_prompt(template, parse_messages(system), encoding).thought == thinking.NONE


def test_the_server_returns_the_thought_apart_as_reasoning_content(server):
    done = server.client().chat.completions.create(
        model="m", messages=ASK, max_tokens=40, extra_body={"grammar": THOUGHT_THEN_REPLY}
    )
    message = done.choices[0].message
    assert message.content == "Four." and message.reasoning_content == "Two and two make four."
    assert done.choices[0].finish_reason == "stop"


def test_a_stream_sends_the_thought_as_delta_reasoning_content_then_the_reply(server):
    chunks = list(
        server.client().chat.completions.create(
            model="m", messages=ASK, max_tokens=40, stream=True, extra_body={"grammar": THOUGHT_THEN_REPLY}
        )
    )
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    thought = "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas)
    reply = "".join(delta.content or "" for delta in deltas)
    assert (thought, reply) == ("Two and two make four.", "Four.")
    firsts = [i for i, delta in enumerate(deltas) if delta.content]
    assert all(not getattr(delta, "reasoning_content", None) for delta in deltas[firsts[0] :])  # thought first


def test_chat_template_kwargs_reach_the_template_and_no_thinking_gives_no_thought(server, smollm2):
    client = server.client()
    off = client.chat.completions.create(
        model="m",
        messages=ASK,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    on = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0)
    assert off.usage.prompt_tokens == len(rendered_ids(smollm2, ASK, enable_thinking=False))
    assert on.usage.prompt_tokens == len(rendered_ids(smollm2, ASK))
    assert off.choices[0].message.reasoning_content is None


def test_with_thinking_off_a_response_format_constrains_the_whole_reply(server):
    schema = {
        "type": "object",
        "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["sum"],
        "additionalProperties": False,
    }
    done = server.client().chat.completions.create(
        model="m",
        messages=ASK,
        max_tokens=60,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content)["sum"], int)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ([1], "must be an object"),
        ({"messages": []}, "may not set 'messages'"),
        ({"not a name": 1}, "not a template variable"),
    ],
)
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(server, kwargs, message):
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().chat.completions.create(
            model="m", messages=ASK, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
        )
    error = raised.value.body
    assert error["param"] == "chat_template_kwargs" and message in error["message"]


def test_a_schema_after_a_thought_accepts_a_thought_then_json_and_nothing_else(smollm2):
    """The grammar a response_format becomes for a thinking prompt, compiled for the real vocabulary: a thought may
    (MAY_OPEN) or must (INSIDE) come first; the reply after it is the schema's JSON."""
    from manas_cli.structured import Vocabulary, compile_format, json_schema_format

    encoding = load_checkpoint(smollm2[1]).encoding
    eot = encoding.encode_single_token("<|im_end|>")
    vocabulary = Vocabulary(encoding, eot)
    schema = json_schema_format({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def accepts(state: str, text: str) -> bool:
        grammar = compile_format(thinking.after_thought(schema, state, encoding.special_tokens_set), vocabulary)
        matcher = grammar.matcher()
        return all(matcher.consume_token(t) for t in encode_text(encoding, text, special=True) + [eot])

    assert accepts(thinking.MAY_OPEN, '<think>\nfour\n</think>\n\n{"a": 4}')
    assert accepts(thinking.MAY_OPEN, '{"a": 4}')
    assert not accepts(thinking.MAY_OPEN, "<think>four</think>Four.")
    assert not accepts(thinking.MAY_OPEN, '<think>a</think>b</think>{"a": 4}')
    assert accepts(thinking.INSIDE, 'four</think> {"a": 4}')
    assert not accepts(thinking.INSIDE, '{"a": 4}')


def test_manas_chat_think_and_no_think_pass_enable_thinking(smollm2):
    off = manas("chat", "-m", smollm2[1], *RUN_OPTIONS, "--chat-template", SMOLLM3, "--no-think", "--json", "-n", "4",
                stdin=b"What is two and two?\n").ok()  # fmt: skip
    on = manas("chat", "-m", smollm2[1], *RUN_OPTIONS, "--chat-template", SMOLLM3, "--think", "--json", "-n", "4",
               stdin=b"What is two and two?\n").ok()  # fmt: skip
    assert json.loads(off.out)["prompt_tokens"] == len(rendered_ids(smollm2, ASK, enable_thinking=False))
    assert json.loads(on.out)["prompt_tokens"] == len(rendered_ids(smollm2, ASK, enable_thinking=True))
    assert "reasoning_content" in json.loads(on.out)
