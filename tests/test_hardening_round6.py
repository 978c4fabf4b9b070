"""Hardening V (issue 56): the sixth hostile round and a new user's habits, each through the real CLI or a live
server on loopback."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from cli_fixtures import RUN_OPTIONS, checkpoints, manas  # noqa: F401 (checkpoints: a fixture)
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
OVER_LIMITS = {"power": "processor time", "format": "needs over", "keyword": "needs over", "indent": "needs over"}


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
