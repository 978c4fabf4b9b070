"""`manas chat`: from a pipe, one message a line, each answer what `manas generate` gives the whole conversation's
rendering alone (greedy and seeded, native and torch), the cache kept between turns; at a terminal, Ctrl-C stops an
answer and the chat goes on, Ctrl-D ends it."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import subprocess
import termios
import time

import pytest

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli_env, manas  # noqa: F401 (checkpoints: a fixture)
from test_serve_chat import TEMPLATE, rendered

jinja2 = pytest.importorskip("jinja2")

LINES = ["What light through yonder window breaks?", "Speak again, bright angel!", "Wherefore art thou Romeo?"]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(TEMPLATE)
    return path


def chat(checkpoints, template_file, lines: list[str], *flags: str, **env: str) -> list[dict]:
    run = manas(
        "chat", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "--chat-template", template_file, "--json", *flags,
        stdin=("\n".join(lines) + "\n").encode(), **env,
    ).ok()  # fmt: skip
    return run.json_lines()


def alone(checkpoints, prompt: str, *flags: str, **env: str) -> dict:
    return (
        manas("generate", "-c", checkpoints["rope-gqa"].path, *RUN_OPTIONS, "-p", prompt, "--json", *flags, **env)
        .ok()
        .json()
    )


@pytest.mark.parametrize(
    ("engine", "sampling"),
    [("native", ("-t", "0")), ("native", ("-t", "0.9", "--seed", "3")), ("torch", ("-t", "0"))],
    ids=["native-greedy", "native-seeded", "torch-greedy"],  # torch's seeded draws are generate's own, tested there
)
def test_each_answer_is_generate_on_the_whole_conversation(checkpoints, template_file, engine, sampling):
    env = {"MANAS_ENGINE": engine}
    answers = chat(checkpoints, template_file, LINES, "-n", "12", *sampling, **env)
    messages = []
    for line, answer in zip(LINES, answers, strict=True):
        messages.append({"role": "user", "content": line})
        expected = alone(checkpoints, rendered(messages), "-n", "12", *sampling, "--top-p", "1", **env)
        assert answer["text"] == expected["text"] and answer["prompt_tokens"] == expected["prompt_tokens"]
        messages.append({"role": "assistant", "content": answer["text"]})
    assert answers[-1]["prompt_tokens"] == 32  # past the window (32 tokens): the conversation's end, cropped


def test_turns_within_the_window_prefill_only_what_they_add(checkpoints, tmp_path):
    """A terse template, so that three turns fit the tiny model's 32-token window."""
    terse = tmp_path / "terse.jinja"
    terse.write_text("{% for message in messages %}{{ message.content }}\n{% endfor %}")
    answers = chat(checkpoints, terse, ["Hi", "Go", "Be"], "-n", "2", "-t", "0")
    assert answers[-1]["prompt_tokens"] < 32
    assert answers[0]["reused_tokens"] == 0 and all(answer["reused_tokens"] >= 3 for answer in answers[1:])


def test_reset_forgets_and_system_sets_the_system_prompt(checkpoints, template_file):
    first, _, again = chat(checkpoints, template_file, [LINES[0], LINES[1], "/reset", LINES[0]], "-n", "8", "-t", "0")[
        :3
    ]
    timings_and_drawn_seed = {key: again[key] for key in ("ttft_s", "decode_tokens_per_s", "seed")}  # greedy
    assert again == {**first, **timings_and_drawn_seed}
    (answer,) = chat(checkpoints, template_file, ["/system Speak as in the play.", LINES[0]], "-n", "8", "-t", "0")
    messages = [{"role": "system", "content": "Speak as in the play."}, {"role": "user", "content": LINES[0]}]
    assert answer["text"] == alone(checkpoints, rendered(messages), "-n", "8", "-t", "0")["text"]


def test_a_base_model_without_a_template_is_one_error_line(checkpoints):
    run = manas("chat", "-c", checkpoints["rope-gqa"].path, stdin=b"hello\n")
    assert run.returncode == 1 and run.err.startswith("error: ") and "--chat-template" in run.err
    assert len(run.err.strip().splitlines()) == 1


def own_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is the pty, so Ctrl-C there is its SIGINT."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_at_a_terminal_ctrl_c_stops_the_answer_and_ctrl_d_ends_the_chat(checkpoints, template_file):
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [*MANAS, "chat", "-c", str(checkpoints["rope-gqa"].path), "--chat-template", str(template_file)]
        + ["-n", "1000000", "-t", "0"],  # greedy, it loops: it runs until it is stopped
        stdin=terminal, stdout=terminal, stderr=terminal, env=cli_env(COLUMNS="100"), preexec_fn=own_terminal,
    )  # fmt: skip
    os.close(terminal)
    seen = b""

    def read_until(marker: bytes, timeout: float = 60.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < deadline:
            if select.select([controller], [], [], 0.2)[0]:
                try:
                    seen += os.read(controller, 4096)
                except OSError:
                    break
        assert marker in seen, seen[-500:]

    try:
        read_until(b">>> ")
        os.write(controller, LINES[0].encode() + b"\r")
        time.sleep(1.5)
        os.write(controller, b"\x03")  # Ctrl-C
        read_until(b"stopped")
        read_until(b">>> ")
        seen = b""
        os.write(controller, b"/reset\r")
        read_until(b"forgotten")
        seen = seen.partition(b"forgotten")[2]
        read_until(b">>> ")  # typed at the prompt, as a person does (readline sets the terminal up as it shows)
        os.write(controller, b"\x04")  # Ctrl-D at the prompt
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(controller)


class Terminal:
    """manas chat in a pseudo-terminal of its own, typed at as a person types (escape sequences for the arrows)."""

    def __init__(self, args: list[str], **env: str) -> None:
        self.controller, terminal = pty.openpty()
        self.process = subprocess.Popen(
            [*MANAS, "chat", *args], stdin=terminal, stdout=terminal, stderr=terminal,
            env=cli_env(COLUMNS="100", **env), preexec_fn=own_terminal,
        )  # fmt: skip
        os.close(terminal)
        self.seen = b""

    def type(self, keys: bytes) -> None:
        os.write(self.controller, keys)

    def read_until(self, marker: bytes, timeout: float = 60.0) -> bytes:
        """What the terminal showed up to and including `marker`, which is then consumed."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen and time.monotonic() < deadline:
            if select.select([self.controller], [], [], 0.2)[0]:
                try:
                    self.seen += os.read(self.controller, 4096)
                except OSError:
                    break
        assert marker in self.seen, self.seen[-500:]
        shown, _, self.seen = self.seen.partition(marker)
        return shown + marker

    def close(self) -> int:
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            os.close(self.controller)


UP, LEFT = b"\x1b[A", b"\x1b[D"


def test_the_prompt_edits_lines_recalls_them_across_chats_and_takes_ollamas_commands(
    checkpoints, template_file, tmp_path
):
    args = ["-c", str(checkpoints["rope-gqa"].path), "--chat-template", str(template_file), "-n", "4"]
    first = Terminal(args, MANAS_HOME=str(tmp_path))
    first.read_until(b">>> ")
    first.type(b"/elp" + LEFT * 3 + b"h\r")  # the cursor moved back, an h put in: /help
    assert b"/set temperature 0.2" in first.read_until(b">>> ")
    first.type(b"/set temperature 0\r")
    assert b"temperature is 0" in first.read_until(b">>> ")
    first.type(b"/set top_k many\r")
    assert b"top_k not set" in first.read_until(b">>> ")
    first.type(LINES[0].encode() + b"\r")
    first.read_until(b"prompt tokens")  # the answer's stats line
    first.read_until(b">>> ")
    first.type(b"/clear\r")
    assert b"forgotten" in first.read_until(b">>> ")
    first.type(b"/exit\r")
    assert first.close() == 0
    kept = tmp_path / "history" / "rope-gqa"
    assert kept.stat().st_mode & 0o777 == 0o600 and LINES[0] in kept.read_text()

    second = Terminal(args, MANAS_HOME=str(tmp_path))
    second.read_until(b">>> ")
    second.type(UP * 5 + b"\r")  # /exit, /clear, the message, /set top_k, /set temperature 0: the first chat's
    assert b"temperature is 0" in second.read_until(b">>> ")
    second.type(b"\x04")
    assert second.close() == 0
