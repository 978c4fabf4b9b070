"""`manas serve`: a real server on an ephemeral loopback port, real clients (the `openai` package, raw sockets):
answers equal `manas generate` alone, OpenAI's shapes and errors, limits, disconnects, signals."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli, cli_env, manas  # noqa: F401 (checkpoints: a fixture)

openai = pytest.importorskip("openai")

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare.safetensors"
READY = re.compile(r"manas serve: http://([\d.]+):(\d+)/v1 · model (\S+) · (\w+) engine · batch size (\d+)")


class LiveServer:
    def __init__(self, process: subprocess.Popen, host: str, port: int, model: str) -> None:
        self.process, self.host, self.port, self.model = process, host, port, model
        self.url = f"http://{host}:{port}/v1"

    def client(self, api_key: str = "none", **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=60, **options)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, dict(response.getheaders()), json.loads(data) if data else None

    def health(self) -> dict:
        return self.raw("GET", "/health")[2]


@contextmanager
def running_server(checkpoint, *args: str):
    process = subprocess.Popen(
        [*MANAS, "serve", "-c", str(checkpoint), "--port", "0", *RUN_OPTIONS, *args],
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    lines = []
    try:
        while (line := process.stderr.readline()) and not READY.search(line):
            lines.append(line)
        found = READY.search(line or "")
        assert found, "".join(lines)
        server = LiveServer(process, found.group(1), int(found.group(2)), found.group(3))
        server.stderr_lines = lines
        threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(
        checkpoints["rope-gqa"].path, "--batch-size", "4", "--timeout", "2", "--max-tokens", "1000000"
    ) as live:
        yield live


def generate_alone(checkpoint, prompt: str, *flags: str) -> dict:
    return manas("generate", "-c", checkpoint.path, *RUN_OPTIONS, "-p", prompt, "--json", *flags).ok().json()


# ---- the answers ----


def test_a_completion_equals_generate_alone(server, checkpoints):
    done = server.client().completions.create(model="any", prompt="ROMEO:", max_tokens=12, temperature=0)
    alone = generate_alone(checkpoints["rope-gqa"], "ROMEO:", "-n", "12", "-t", "0")
    (choice,) = done.choices
    assert choice.text == alone["text"] and choice.finish_reason == "length" and choice.index == 0
    assert done.usage.prompt_tokens == alone["prompt_tokens"]
    assert done.usage.completion_tokens == alone["generated_tokens"] == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    assert done.id.startswith("cmpl-") and done.model == server.model == "rope-gqa" and done.object == "text_completion"


def test_streamed_chunks_add_up_to_the_same_completion(server):
    client = server.client()
    whole = client.completions.create(model="m", prompt="JULIET:", max_tokens=20, temperature=0.7, seed=5)
    chunks = list(
        client.completions.create(
            model="m",
            prompt="JULIET:",
            max_tokens=20,
            temperature=0.7,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].text
    finishing = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishing == ["length"]
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []


def test_n_choices_are_rows_each_equal_to_generate_with_its_seed(server, checkpoints):
    done = server.client().completions.create(model="m", prompt="KING:", max_tokens=10, temperature=1.0, seed=40, n=3)
    assert [choice.index for choice in done.choices] == [0, 1, 2]
    for index, choice in enumerate(done.choices):
        alone = generate_alone(checkpoints["rope-gqa"], "KING:", "-n", "10", "-t", "1.0", "--seed", str(40 + index))
        assert choice.text == alone["text"]
    assert done.usage.completion_tokens == 30


def test_a_stop_string_ends_the_choice_and_is_not_returned(server):
    client = server.client()
    free = client.completions.create(model="m", prompt="ROMEO:", max_tokens=30, temperature=0).choices[0].text
    stop = free[5:7]
    done = client.completions.create(model="m", prompt="ROMEO:", max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].text == free[: free.index(stop)]


def test_logprobs_take_openais_legacy_shape(server, checkpoints):
    done = server.client().completions.create(model="m", prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=2)
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == done.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert all(
        len(top) <= 2 and max(top.values()) >= chosen - 1e-6
        for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )
    alone = generate_alone(checkpoints["rope-gqa"], "ROMEO:", "-n", "6", "-t", "0", "--logprobs", "2")
    assert logprobs.token_logprobs == pytest.approx([entry["logprob"] for entry in alone["logprobs"]], abs=1e-6)


def test_a_seed_reproduces_and_another_seed_differs(server):
    client = server.client()
    runs = [
        client.completions.create(model="m", prompt="A", max_tokens=24, temperature=1.0, seed=seed).choices[0].text
        for seed in (3, 3, 4)
    ]
    assert runs[0] == runs[1] != runs[2]


def test_a_list_of_prompts_gets_a_choice_each_and_echo_prepends_the_prompt(server):
    client = server.client()
    done = client.completions.create(model="m", prompt=["ROMEO:", "JULIET:"], max_tokens=4, temperature=0, echo=True)
    alone = [
        client.completions.create(model="m", prompt=p, max_tokens=4, temperature=0).choices[0].text
        for p in ("ROMEO:", "JULIET:")
    ]
    assert [choice.text for choice in done.choices] == ["ROMEO:" + alone[0], "JULIET:" + alone[1]]
    assert [choice.index for choice in done.choices] == [0, 1]


def test_manas_own_sampling_fields_are_taken_as_extra_body(server, checkpoints):
    done = server.client().completions.create(
        model="m",
        prompt="ROMEO:",
        max_tokens=10,
        temperature=0.9,
        seed=2,
        extra_body={"top_k": 5, "repetition_penalty": 1.3, "min_p": 0.05},
    )
    alone = generate_alone(
        checkpoints["rope-gqa"],
        "ROMEO:",
        "-n",
        "10",
        "-t",
        "0.9",
        "--seed",
        "2",
        "--top-k",
        "5",
        "--repetition-penalty",
        "1.3",
        "--min-p",
        "0.05",
    )
    assert done.choices[0].text == alone["text"]


# ---- errors in OpenAI's shape ----


@pytest.mark.parametrize(
    "options, param, message",
    [
        (dict(temperature=-1), "temperature", "temperature must be a finite number >= 0, got -1"),
        (dict(max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1, got 0"),
        (dict(n=99), "n", "n must be an integer from 1 to 16, got 99"),
        (dict(extra_body={"best_of": 2}), "best_of", "best_of 2 is not supported: manas takes null or 1"),
        (dict(extra_body={"logit_bias": {"50": 3}}), "logit_bias", "is not supported: manas takes null or {}"),
        (dict(top_p=1.5), "top_p", "top_p must be a number with 0 < top_p <= 1, got 1.5"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(server, options, param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().completions.create(model="m", prompt="A", **options)
    error = raised.value.body
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"


def test_chat_completions_is_a_404_pointing_at_completions(server):
    with pytest.raises(openai.NotFoundError) as raised:
        server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert "/v1/completions" in raised.value.body["message"] and "--chat-template" in raised.value.body["message"]


def test_health_and_models(server):
    assert server.health()["status"] == "ok"
    models = server.client().models.list()
    assert [model.id for model in models.data] == ["rope-gqa"]


@pytest.mark.parametrize(
    "body, headers, status, message",
    [
        (b"{not json", {"Content-Type": "application/json"}, 400, "not JSON"),
        (b'{"prompt": "a"}', {"Content-Type": "text/plain"}, 415, "application/json"),
        (b'["a"]', {"Content-Type": "application/json"}, 400, "must be a JSON object"),
        (b'{"prompt": "a", "max_tokens": NaN}', {"Content-Type": "application/json"}, 400, "NaN is not a JSON number"),
        (b'{"prompt": "\xff"}', {"Content-Type": "application/json"}, 400, "not UTF-8"),
    ],
)
def test_raw_bodies_the_client_would_not_send_get_openai_errors(server, body, headers, status, message):
    code, _, answer = server.raw("POST", "/v1/completions", body, headers)
    assert code == status and message in answer["error"]["message"]


def test_a_10_mb_body_is_refused_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10485760\r\n\r\n" + b"x" * 65536
        )
        answer = sock.makefile("rb").read()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"at most 1,048,576" in body


def test_a_truncated_body_and_a_slow_client_do_not_stop_the_server(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt"'
        )
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest of the headers
    time.sleep(3)  # past the server's --timeout 2
    assert slow.recv(1024) == b""  # the server hung up on it
    slow.close()
    assert server.client().completions.create(model="m", prompt="A", max_tokens=2).usage.completion_tokens == 2


def test_sixteen_clients_at_once_each_get_what_they_would_alone(server, checkpoints):
    prompts = [f"{name}:" for name in ("ROMEO", "JULIET", "KING", "QUEEN")] * 4
    results = [None] * len(prompts)

    def ask(index: int) -> None:
        results[index] = (
            server.client()
            .completions.create(model="m", prompt=prompts[index], max_tokens=8 + index, temperature=0.8, seed=index)
            .choices[0]
            .text
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    requests = [
        json.dumps({"prompt": p, "max_tokens": 8 + i, "temperature": 0.8, "seed": i}) for i, p in enumerate(prompts)
    ]
    alone = cli(
        "generate",
        "-c",
        str(checkpoints["rope-gqa"].path),
        *RUN_OPTIONS,
        "--jsonl",
        stdin="\n".join(requests) + "\n",
        text=True,
    )
    assert results == [json.loads(line)["text"] for line in alone.stdout.splitlines()]


def test_a_client_that_disconnects_mid_stream_frees_its_row(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 1_000_000, "stream": True, "temperature": 0.8})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    assert server.health()["rows"] == 1
    response.close()  # the socket itself: the response holds it open past connection.close()
    connection.close()
    deadline = time.monotonic() + 10
    while server.health()["rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["rows"] == 0


# ---- keys, limits, lifecycle ----


def test_a_wrong_or_missing_key_is_a_401(checkpoints):
    with running_server(checkpoints["rope-gqa"].path, "--api-key", "s3cret") as live:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").completions.create(model="m", prompt="A", max_tokens=2)
        assert live.raw("GET", "/v1/models")[0] == 401
        assert live.client(api_key="s3cret").completions.create(model="m", prompt="A", max_tokens=2).choices


def test_the_key_may_come_from_the_environment(checkpoints, monkeypatch):
    monkeypatch.setenv("MANAS_API_KEY", "from-env")
    with running_server(checkpoints["rope-gqa"].path) as live:
        assert live.raw("GET", "/v1/models")[0] == 401
        assert live.raw("GET", "/v1/models", headers={"Authorization": "Bearer from-env"})[0] == 200


def test_requests_past_the_queue_get_429_with_retry_after(checkpoints):
    with running_server(
        checkpoints["rope-gqa"].path, "--batch-size", "1", "--max-queue", "1", "--max-tokens", "3000"
    ) as live:
        statuses = []

        def ask() -> None:
            body = json.dumps({"prompt": "A", "max_tokens": 3000}).encode()
            code, headers, _ = live.raw("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            statuses.append((code, headers.get("Retry-After")))

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert (429, "1") in statuses and (200, None) in statuses


def test_sigterm_lets_a_request_in_flight_finish_then_exits_0(checkpoints):
    with running_server(checkpoints["rope-gqa"].path) as live:
        answer = {}

        def ask() -> None:
            answer["done"] = live.client().completions.create(model="m", prompt="A", max_tokens=200)

        thread = threading.Thread(target=ask)
        thread.start()
        time.sleep(0.3)
        live.process.send_signal(signal.SIGTERM)
        thread.join(60)
        assert live.process.wait(timeout=60) == 0
        assert answer["done"].usage.completion_tokens == 200


def test_a_port_in_use_is_one_error_line(server, checkpoints):
    done = manas("serve", "-c", checkpoints["rope-gqa"].path, "--port", str(server.port), *RUN_OPTIONS)
    assert done.returncode == 1
    assert (
        done.err.strip() == f"error: cannot listen on 127.0.0.1:{server.port}: the port is in use; choose another "
        "with --port"
    )


def test_another_host_without_a_key_warns_and_loopback_does_not(checkpoints):
    with running_server(checkpoints["rope-gqa"].path, "--host", "127.0.0.2") as live:  # loopback, but not the default
        assert any(line.startswith("warning: listening on 127.0.0.2 without --api-key") for line in live.stderr_lines)
        assert live.health()["status"] == "ok"
    with running_server(checkpoints["rope-gqa"].path) as live:
        assert not any("warning" in line for line in live.stderr_lines)


def test_the_readme_serving_examples_run_as_written(tmp_path):
    """The README's Serving section against a live server of the shipped model: its port is this test's own."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Serving", 1)[1].split("\n## ", 1)[0]
    (shell,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    (python,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert shell.startswith("manas serve --port 8080 &\n")
    with running_server(SHIPPED) as live:
        curl = shell.split("\n", 1)[1].replace("8080", str(live.port))
        if subprocess.run(["sh", "-c", "command -v curl && command -v jq"], capture_output=True).returncode == 0:
            done = subprocess.run(["bash", "-o", "pipefail", "-c", curl], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.strip(), done.stderr
        done = subprocess.run(
            [sys.executable, "-c", python.replace("8080", str(live.port))], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
