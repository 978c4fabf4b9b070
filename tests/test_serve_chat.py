"""POST /v1/chat/completions on a live `manas serve`: the messages rendered through the model's chat template (here
given with --chat-template), answered as `manas generate` answers the rendered prompt alone, in OpenAI's chat shapes
(message, delta chunks, chat logprobs), through the real openai client, LangChain's ChatOpenAI and llm; and every
template that fails, loops or explodes is one error, never a hang."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli_env, manas  # noqa: F401 (checkpoints: a fixture)
from test_serve import running_server

openai = pytest.importorskip("openai")
jinja2 = pytest.importorskip("jinja2")

TEMPLATE = (
    "{% for message in messages %}{{ message.role | upper }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}ROMEO:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Speak as in the play."},
    {"role": "user", "content": "What light through yonder window breaks?"},
]


def rendered(messages: list[dict]) -> str:
    """The prompt, rendered by jinja2 itself with transformers' settings (not by manas)."""
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def chat_server(checkpoints, template_file):
    with running_server(
        checkpoints["rope-gqa"].path, "--batch-size", "4", "--chat-template", str(template_file)
    ) as live:
        yield live


def generate_alone(checkpoints, prompt: str, *flags: str) -> dict:
    return (
        manas("generate", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "-p", prompt, "--json", *flags).ok().json()
    )


def test_a_chat_answer_is_generate_on_the_rendered_prompt(chat_server, checkpoints):
    done = chat_server.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0)
    alone = generate_alone(checkpoints, rendered(MESSAGES), "-n", "20", "-t", "0")
    (choice,) = done.choices
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == alone["text"]
    assert choice.finish_reason == "length"
    assert done.usage.prompt_tokens == alone["prompt_tokens"] and done.usage.completion_tokens == 20


def test_streamed_deltas_name_the_role_first_and_add_up_to_the_answer(chat_server):
    client = chat_server.client()
    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_n_seeded_choices_are_each_generate_with_its_seed(chat_server, checkpoints):
    done = chat_server.client().chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, temperature=0.9, n=2, seed=5
    )
    for index, choice in enumerate(done.choices):
        alone = generate_alone(
            checkpoints, rendered(MESSAGES), "-n", "12", "-t", "0.9", "--top-p", "1", "--seed", str(5 + index)
        )
        assert choice.index == index and choice.message.content == alone["text"]


def test_logprobs_take_the_chat_shape(chat_server, checkpoints):
    done = chat_server.client().chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    alone = generate_alone(checkpoints, rendered(MESSAGES), "-n", "6", "-t", "0", "--logprobs", "3")
    content = done.choices[0].logprobs.content
    assert [entry.token for entry in content] == [entry["text"] for entry in alone["logprobs"]]
    assert [entry.logprob for entry in content] == pytest.approx([e["logprob"] for e in alone["logprobs"]], abs=1e-5)
    assert all(len(entry.top_logprobs) == 3 and bytes(entry.bytes).decode() == entry.token for entry in content)
    plain = chat_server.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0] must be an object with a role"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 2}, "max_completion_tokens", "not both"),
        ({"messages": MESSAGES, "logit_bias": {"5": 1}}, "logit_bias", "is not supported"),
        ({"messages": MESSAGES, "prompt": "x"}, "prompt", "unknown field 'prompt'"),
    ],
)
def test_a_bad_chat_field_is_a_400_naming_it(chat_server, body, param, message):
    status, _, answer = chat_server.raw(
        "POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"]


def test_the_model_is_retrieved_by_its_id(chat_server):
    client = chat_server.client()
    assert client.models.retrieve(chat_server.model).id == chat_server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another")


def test_langchains_chat_model_talks_to_the_server(chat_server, checkpoints):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        base_url=chat_server.url, api_key="none", model="m", temperature=0, max_tokens=10, max_retries=0
    )
    answer = model.invoke([("system", MESSAGES[0]["content"]), ("human", MESSAGES[1]["content"])])
    assert answer.content == generate_alone(checkpoints, rendered(MESSAGES), "-n", "10", "-t", "0")["text"]


def test_llm_chats_through_the_server(chat_server, checkpoints, tmp_path):
    pytest.importorskip("llm")
    home = tmp_path / "llm"
    home.mkdir()
    models = [{"model_id": "manas", "model_name": "m", "api_base": chat_server.url}]
    (home / "extra-openai-models.yaml").write_text(json.dumps(models))  # YAML is a superset of JSON
    llm_bin = os.path.join(os.path.dirname(MANAS[0]), "llm")
    done = subprocess.run(
        [llm_bin, "-m", "manas", "-o", "temperature", "0", "-o", "max_tokens", "10", MESSAGES[1]["content"]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**cli_env(), "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "none"},
    )
    assert done.returncode == 0, done.stderr
    messages = [{"role": "user", "content": MESSAGES[1]["content"]}]
    assert done.stdout.rstrip("\n") == generate_alone(checkpoints, rendered(messages), "-n", "10", "-t", "0")[
        "text"
    ].rstrip("\n")


# ---- templates that fail ----

FAILING = {
    "raises": ("{{ raise_exception('only user messages') }}", "refused the messages: only user messages"),
    "loops": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "loops too long"),
    "explodes": ("{{ 'x' * 1000000000 }}", "builds a value over"),
    "explodes-by-a-call": ("{{ 'x'.ljust(1000000000) }}", "passes a number over"),
    "reaches-outside": ("{{ cycler.__init__.__globals__.os.system('true') }}", "is unsafe"),
}


@pytest.mark.parametrize("case", FAILING)
def test_a_template_that_fails_is_one_error_never_a_hang(checkpoints, tmp_path, case):
    template, message = FAILING[case]
    path = tmp_path / "t.jinja"
    path.write_text(template)
    with running_server(checkpoints["rope-gqa"].path, "--chat-template", str(path)) as live:
        status, _, answer = live.raw(
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 400 and message in answer["error"]["message"]
        assert live.health()["status"] == "ok"


def test_a_template_that_does_not_parse_is_refused_at_start(checkpoints, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for message in messages %}")
    run = manas("serve", "-c", checkpoints["rope-gqa"].path, "--port", "0", "--chat-template", path)
    assert run.returncode == 1 and run.err.startswith("error: the chat template does not parse")


# ---- the exact prefix cache ----


def test_a_chat_through_the_prefix_cache_answers_as_a_server_without_it(checkpoints, tmp_path):
    """Turn after turn, each request starts with the one before: the cache copies that start and prefills the rest,
    and every answer is the one a server without the cache gives (the native engine: bit for bit). A terse template,
    so that four turns fit the tiny model's 32-token window."""
    path, terse = checkpoints["rope-gqa"].path, tmp_path / "terse.jinja"
    terse.write_text("{% for message in messages %}{{ message.content }}\n{% endfor %}")
    with running_server(path, "--chat-template", str(terse)) as cached:
        with running_server(path, "--chat-template", str(terse), "--prefix-cache-mb", "0") as plain:
            messages, earlier_prompts = [{"role": "system", "content": "Be."}], 0
            for turn in ("Hi", "Go", "Be", "No"):
                messages.append({"role": "user", "content": turn})
                answers = [
                    server.client().chat.completions.create(
                        model="m", messages=messages, max_tokens=2, temperature=0.8, seed=11, logprobs=True
                    )
                    for server in (cached, plain)
                ]
                assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
                assert answers[0].choices[0].logprobs == answers[1].choices[0].logprobs  # the same floats
                messages.append({"role": "assistant", "content": answers[0].choices[0].message.content})
                earlier_prompts += answers[0].usage.prompt_tokens if turn != "No" else 0
            assert "prefix_cache" not in plain.health()
        health = cached.health()["prefix_cache"]
        # each turn reuses the turn before's prompt and more: its answer, kept when it finished
        assert health["hits"] == 3 and health["reused_tokens"] > earlier_prompts


def test_the_prefix_cache_stays_within_its_memory(checkpoints):
    with running_server(checkpoints["rope-gqa"].path, "--prefix-cache-mb", "0.1") as live:
        client = live.client()
        for i in range(40):
            client.completions.create(model="m", prompt=f"ROMEO {i}: " * 3, max_tokens=1, temperature=0)
        health = live.health()["prefix_cache"]
        assert 0 < health["bytes"] <= 0.1 * 2**20 and health["entries"] < 40
