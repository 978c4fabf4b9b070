"""Hardening V (issue 56): the sixth hostile round and a new user's habits, each through the real CLI or a live
server on loopback."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import threading

import pytest

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli_env, manas  # noqa: F401 (fixtures)
from test_serve import running_server

jinja2 = pytest.importorskip("jinja2")

# ---- 1. a chat template is bounded by the operating system, not only by its checks ----

# Each message's content picks a case, so one server answers them all. None of the expressions is constant
# (messages|length is 1): jinja2 would run a constant one while compiling, at the server's start.
HOSTILE = (
    "{% set n = messages|length %}{% set case = messages[-1].content %}"
    "{% if case == 'power' %}{{ (((((n + 9) ** 64) ** 64) ** 64) ** 64) ** 8 > 1 }}"
    "{% elif case == 'format' %}{{ '%0900000000d' % n }}"
    "{% elif case == 'keyword' %}{{ 'x'|center(width=n * 1500000000) }}"
    "{% elif case == 'indent' %}{{ [n]|tojson(indent=n * 900000000) }}"
    "{% else %}USER: {{ case }}\nROMEO:{% endif %}"
)
OVER_LIMITS = {"power": "does too much work", "format": "needs over", "keyword": "needs over", "indent": "needs over"}


@pytest.fixture(scope="module")
def hostile_server(checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "template.jinja"
    path.write_text(HOSTILE)
    with running_server(checkpoints["rope-gqa"].path, "--chat-template", str(path)) as live:
        yield live


def chat(live, content: str, **headers: str):
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()
    return live.raw("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **headers})


@pytest.mark.parametrize("case", OVER_LIMITS)
def test_a_template_past_the_os_limits_is_a_400_and_the_next_chat_renders(hostile_server, case):
    status, _, answer = chat(hostile_server, case)
    assert status == 400 and OVER_LIMITS[case] in answer["error"]["message"], answer
    status, _, answer = chat(hostile_server, "hello")  # the worker, killed or not, serves the next request
    assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant"


def test_health_and_completions_answer_while_a_template_burns_its_limit(hostile_server):
    burning = threading.Thread(target=chat, args=(hostile_server, "power"))
    burning.start()
    try:
        for _ in range(3):
            assert hostile_server.health()["status"] == "ok"
            completion = hostile_server.client().completions.create(model="m", prompt="ROMEO:", max_tokens=2)
            assert completion.choices[0].finish_reason in ("length", "stop")
        assert burning.is_alive()  # all of that while the template still ran (its limit is 2 s of processor time)
    finally:
        burning.join()


def test_a_constant_that_builds_gigabytes_while_compiling_is_one_error_line(checkpoints, tmp_path):
    """jinja2 folds `"%0900000000d" % 1` while compiling: the worker's memory limit stops the fold (which jinja2 then
    leaves to the render), and the first render is one error."""
    path = tmp_path / "t.jinja"
    path.write_text('{{ "%0900000000d" % 1 }}')
    run = manas("chat", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "--chat-template", path, stdin=b"hi\n")
    assert run.returncode == 1 and run.err.startswith("error: the chat template needs over"), run.err
    assert len(run.err.strip().splitlines()) == 1


# ---- 3. a client gone before its error reply ----


def test_a_client_gone_before_its_error_reply_is_one_line_not_a_traceback(hostile_server):
    body = json.dumps({"messages": [{"role": "user", "content": "power"}], "max_tokens": 2}).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((hostile_server.host, hostile_server.port)) as sock:
        sock.sendall(request)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    while not any("left before its 400 reply" in line for line in hostile_server.stderr_lines):
        assert hostile_server.health()["status"] == "ok"
        threading.Event().wait(0.2)
    assert not any("Traceback" in line for line in hostile_server.stderr_lines)


# ---- 4. float flags refuse nan and inf ----


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["serve", "--prefix-cache-mb", "nan"], "'--prefix-cache-mb'"),
        (["serve", "--prefix-cache-mb", "inf"], "'--prefix-cache-mb'"),
        (["generate", "-p", "x", "--temperature", "nan"], "'--temperature'"),
        (["generate", "-p", "x", "--top-p", "-inf"], "'--top-p'"),
        (["train", "x.txt", "--out", "y", "--lr", "inf"], "'--lr'"),
    ],
)
def test_a_float_flag_that_is_not_finite_is_a_usage_error_naming_it(args, flag):
    run = manas(*args)
    assert run.returncode == 2 and run.err.startswith("error: ") and flag in run.err and "not a finite" in run.err
    assert "unexpected" not in run.err and len(run.err.strip().splitlines()) == 1


# ---- 9, 10. every command that takes a checkpoint takes a store name and -m; a folder does not hide a name ----


@pytest.mark.parametrize("command", ["quantize", "export"])
def test_quantize_and_export_take_a_store_name_as_argument_or_m(command, tmp_path):
    out = tmp_path / ("q.safetensors" if command == "quantize" else "exported")
    argument = manas(command, "shakespeare", "--out", out, "--force").ok()
    option = manas(command, "-m", "shakespeare", "--out", out, "--force").ok()
    assert argument.err == option.err and out.exists()
    missing = manas(command, "-m", "absent-model", "--out", out)
    assert missing.returncode == 1 and missing.err.startswith("error: no model 'absent-model'")


@pytest.mark.parametrize("command", ["quantize", "export"])
def test_a_missing_checkpoint_is_refused_before_torch_is_imported(command, tmp_path):
    from test_torch_free import probe

    code, last = probe(command, tmp_path / "absent.safetensors", "--out", tmp_path / "out")
    assert code == 1 and last == "torch never imported"


def test_a_folder_named_like_a_store_model_does_not_hide_it(tmp_path):
    folder = tmp_path / "shakespeare"
    folder.mkdir()
    in_folder = subprocess.run(
        [*MANAS, "generate", "-m", "shakespeare", "-p", "ROMEO:", "-n", "4", "-t", "0", "--json"],
        cwd=tmp_path,
        capture_output=True,
        env=cli_env(),
        timeout=300,
    )
    elsewhere = manas("generate", "-m", "shakespeare", "-p", "ROMEO:", "-n", "4", "-t", "0", "--json").ok()
    assert in_folder.returncode == 0 and json.loads(in_folder.stdout)["tokens"] == elsewhere.json()["tokens"]


def test_a_hugging_face_folder_given_as_a_checkpoint_says_to_convert_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    run = manas("generate", "-m", tmp_path, "-p", "x")
    assert run.returncode == 1 and "is a Hugging Face folder: convert it first (manas convert" in run.err


# ---- 14. text content parts; a JSON body without its type ----


def chat_body(content) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}).encode()


def test_text_content_parts_are_the_texts_joined_by_newlines(hostile_server):
    headers = {"Content-Type": "application/json"}
    parts = [{"type": "text", "text": "good"}, {"type": "text", "text": "morrow"}]
    status, _, by_parts = hostile_server.raw("POST", "/v1/chat/completions", chat_body(parts), headers)
    _, _, by_text = hostile_server.raw("POST", "/v1/chat/completions", chat_body("good\nmorrow"), headers)
    assert status == 200 and by_parts["choices"][0]["message"] == by_text["choices"][0]["message"]
    assert by_parts["usage"] == by_text["usage"]
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    status, _, refused = hostile_server.raw("POST", "/v1/chat/completions", chat_body(image), headers)
    assert status == 400 and "manas takes no 'image_url' parts" in refused["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Content-Type": "application/x-www-form-urlencoded"}])
def test_a_json_body_without_its_type_is_read_as_json(hostile_server, headers):
    """curl -d sends no JSON type (its default is a form's); llama-server and ollama read the body as JSON."""
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}).encode()
    status, _, answer = hostile_server.raw("POST", "/v1/completions", body, headers)
    _, _, typed = hostile_server.raw("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200 and answer["choices"][0]["text"] == typed["choices"][0]["text"]


# ---- 13, 15. one default temperature; chat --json says what reproduces it; --help and --ctx say what they mean ----


def test_a_seed_gives_one_text_from_generate_chat_and_the_server_without_a_temperature(
    hostile_server, checkpoints, tmp_path
):
    path = tmp_path / "template.jinja"
    path.write_text(HOSTILE)
    model = checkpoints["rope-gqa"].path
    alone = manas("generate", "-c", model, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "8", "--seed", "7", "--json").ok()
    served = hostile_server.client().completions.create(model="m", prompt="ROMEO:", max_tokens=8, seed=7)
    assert served.choices[0].text == alone.json()["text"] and alone.json()["temperature"] == 0.8
    chat = manas(
        "chat", "-c", model, *RUN_OPTIONS, "--chat-template", path, "-n", "8", "--seed", "7", "--json",
        stdin=b"hello\n",
    ).ok().json()  # fmt: skip
    served = hostile_server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=7
    )
    assert served.choices[0].message.content == chat["text"]
    assert chat["seed"] == 7 and chat["engine"] == alone.json()["engine"]
    assert chat["arithmetic_version"] == alone.json()["arithmetic_version"]
    assert len(chat["tokens"]) == chat["generated_tokens"] and chat["tokens"]


def test_chat_help_shows_its_example_as_typed():
    assert "printf 'Hello!\\nWhat did I just say?\\n' | manas chat" in manas("chat", "--help").ok().out.replace(
        "\n    ", " "
    )


def test_a_ctx_over_the_window_says_the_window_it_keeps(checkpoints):
    run = manas("generate", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "-p", "x", "-n", "2", "--ctx", "5000")
    assert run.ok().err.strip() == "notice: --ctx 5,000 is over the model's window: it keeps its 32 tokens"


# ---- 11. special tokens written in a prompt are those tokens, unless --no-special ----

CHATML_PROMPT = "<|im_start|>user\nthe weather<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def instruct(tmp_path_factory, tiny_bpe_spec):
    """A Qwen2-shaped folder (its tokenizer.json made by Hugging Face's tokenizers, with ChatML's special tokens)
    and its conversion, with ChatML's template."""
    from test_llama_family import CHATML, converted, hf_folder

    folder = tmp_path_factory.mktemp("instruct")
    hf_folder(folder / "hf", tiny_bpe_spec, "qwen2")
    (folder / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return folder / "hf", converted(folder, folder / "hf")


def test_a_prompts_special_tokens_are_encoded_as_transformers_encodes_them(instruct):
    from transformers import AutoTokenizer

    folder, model = instruct
    tokenizer = AutoTokenizer.from_pretrained(folder)
    parsed = len(tokenizer(CHATML_PROMPT)["input_ids"])
    plain = len(tokenizer(CHATML_PROMPT, split_special_tokens=True)["input_ids"])
    assert parsed < plain
    flags = ("-c", model, *RUN_OPTIONS, "-p", CHATML_PROMPT, "-n", "1", "-t", "0", "--json")
    assert manas("generate", *flags).ok().json()["prompt_tokens"] == parsed
    assert manas("generate", *flags, "--no-special").ok().json()["prompt_tokens"] == plain
    lines = [{"prompt": CHATML_PROMPT, "max_tokens": 1}, {"prompt": CHATML_PROMPT, "parse_special": False}]
    stdin = "\n".join(json.dumps(line) for line in lines).encode()
    records = manas("generate", "--jsonl", "-c", model, *RUN_OPTIONS, "-n", "1", stdin=stdin).ok().json_lines()
    assert [record["prompt_tokens"] for record in records] == [parsed, plain]


def test_the_servers_completions_parse_special_tokens_unless_told_not_to(hostile_server, checkpoints):
    prompt = "ROMEO:<|endoftext|>JULIET:"
    alone = manas("generate", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "-p", prompt, "-n", "1", "--json")
    counts = []
    for extra in ({}, {"parse_special": False}):
        done = hostile_server.client().completions.create(model="m", prompt=prompt, max_tokens=1, extra_body=extra)
        counts.append(done.usage.prompt_tokens)
    assert counts[0] == alone.ok().json()["prompt_tokens"] and counts[0] < counts[1]


# ---- 12. llama.cpp's and ollama's habits ----


def test_llama_cpps_flags_do_what_they_do_there(checkpoints, tmp_path):
    model = checkpoints["rope-gqa"].path
    (tmp_path / "prompt.txt").write_text("ROMEO:")
    theirs = manas(
        "generate", "-c", model, *RUN_OPTIONS, "-f", tmp_path / "prompt.txt", "--temp", "0.5", "-s", "3", "-n", "-1",
        "--ctx-size", "20", "--json",
    ).ok().json()  # fmt: skip
    ours = manas(
        "generate", "-c", model, *RUN_OPTIONS, "-p", "ROMEO:", "-t", "0.5", "--seed", "3", "-n", "40", "--ctx", "20",
        "--json",
    ).ok().json()  # fmt: skip
    # -n -1: until the end of text or the window (20 positions), the text a longer -n gives up to there
    assert theirs["prompt_tokens"] + theirs["generated_tokens"] == 20 or theirs["finish_reason"] == "end_of_text"
    assert ours["tokens"][: len(theirs["tokens"])] == theirs["tokens"] and theirs["seed"] == 3
    for bad in ("0", "-2"):
        refused = manas("generate", "-c", model, "-p", "x", "-n", bad)
        assert refused.returncode == 2 and "or -1 (until the end of text or the window)" in refused.err


def test_a_number_given_as_the_model_hints_at_ctx():
    run = manas("generate", "-c", "2048", "-p", "x")
    assert run.returncode == 1 and run.err.strip().endswith("the window in tokens is --ctx 2048 (llama.cpp's -c)")


@pytest.mark.parametrize(("command", "hint"), [("show", "manas list shows"), ("ps", "manas serve holds one")])
def test_ollamas_commands_name_the_manas_command(command, hint):
    run = manas(command, "x")
    assert run.returncode == 2 and hint in run.err and len(run.err.strip().splitlines()) == 1


def test_run_continues_with_a_base_model_and_answers_with_a_chat_model(checkpoints, instruct):
    model = checkpoints["rope-gqa"].path
    continued = manas("run", model, "ROMEO:", *RUN_OPTIONS, "-n", "6", "-t", "0").ok()
    assert continued.out == manas("generate", "-c", model, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "6", "-t", "0").ok().out
    refused = manas("run", model)
    assert refused.returncode == 1 and "is a base model" in refused.err
    _, chat_model = instruct
    answered = manas("run", chat_model, "the weather", *RUN_OPTIONS, "-n", "6", "-t", "0").ok()
    chatted = manas("chat", "-c", chat_model, *RUN_OPTIONS, "-n", "6", "-t", "0", stdin=b"the weather\n").ok()
    assert answered.out == chatted.out and answered.out.strip()
