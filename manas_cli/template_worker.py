"""Chat templates rendered in a separate, long-lived process whose time and memory the operating system bounds.

A template is code from a file. The checks in chat_template catch the usual hostile one at once, but they cannot
bound one step: jinja2 folds constant expressions while it compiles (`{{ "%0900000000d" % 1 }}` builds 900 MB
before any render), an integer power chain runs for minutes holding the interpreter's lock, a filter's keyword
builds a gigabyte. So every compile and render runs in a worker process under RLIMIT_AS (its memory) and
RLIMIT_CPU (its processor time, renewed per request), and the caller waits on a pipe with a wall-clock deadline:
a worker past any of the three is killed and the next request starts a fresh one. A server's other requests
(/health, completions) never wait on a template; chat requests take turns, each waiting at most WALL_S for every
template render ahead of it.

The protocol is one JSON line each way: {"template", "messages" (null: compile only), "bos", "eos", "tools"} in,
{"text"} or {"error"} out."""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from .chat_template import TemplateError, require_jinja2
from .errors import first_line

CPU_S = 2  # processor time per request: Llama 3.1's template renders 40 messages in about 1 ms here
WALL_S = 5.0  # the caller's deadline per request, on a busy machine too
START_S = 30.0  # a worker's start (Python and jinja2's import), on a busy machine
MEMORY_BYTES = 512 * 2**20  # address space the worker may add to what it holds at its start
MAX_REPLY_BYTES = 16 * 2**20  # a rendered prompt is at most 1 Mi characters (chat_template.MAX_VALUE_CHARS)


class TemplateWorker:
    """The caller's side: one worker process, started on first use, restarted after it dies or is killed. Calls
    from several threads take turns (a template renders in milliseconds; a hostile one holds the turn WALL_S)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def compile(self, template: str) -> None:
        self._ask({"template": template, "messages": None, "bos": "", "eos": ""})

    def render(
        self, template: str, messages: list[dict], bos_token: str, eos_token: str, tools: list | None = None
    ) -> str:
        return self._ask(
            {"template": template, "messages": messages, "bos": bos_token, "eos": eos_token, "tools": tools}
        )

    def _ask(self, request: dict) -> str:
        with self._lock:
            process = self._started()
            try:
                process.stdin.write((json.dumps(request) + "\n").encode())
                process.stdin.flush()
            except OSError:  # killed from outside since it was started: the next request starts a fresh one
                self._stop()
                raise TemplateError("the chat template's worker stopped: send the request again") from None
            line = self._reply(process, WALL_S)
        reply = json.loads(line)
        if "error" in reply:
            raise TemplateError(reply["error"])
        return reply["text"]

    def _started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        require_jinja2()
        root = str(Path(__file__).resolve().parent.parent)
        # -I: neither the caller's folder nor PYTHON* variables decide what the worker imports; the package is
        # found where this file is.
        code = f"import sys; sys.path.insert(0, {root!r}); from manas_cli.template_worker import main; main()"
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal is the caller's to handle, not the worker's
        )
        ready = self._reply(self._process, START_S)
        if json.loads(ready) != {"ready": True}:
            self._stop()
            raise TemplateError("the chat template worker did not start")
        return self._process

    def _reply(self, process: subprocess.Popen, timeout_s: float) -> str:
        """The worker's next line, or TemplateError when it dies, runs past timeout_s, or answers too much."""
        deadline, data = time.monotonic() + timeout_s, b""
        fd = process.stdout.fileno()
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._stop()
                raise TemplateError(f"the chat template ran over {timeout_s:g} s: it does too much work")
            chunk = os.read(fd, 1 << 16)
            if not chunk or len(data) + len(chunk) > MAX_REPLY_BYTES:
                died = process.poll() if chunk else process.wait()
                self._stop()
                raise TemplateError(_death(died))
            data += chunk
        return data.decode()

    def _stop(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                pipe.close()
            self._process = None


def _death(returncode: int | None) -> str:
    import signal

    if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL:
        return f"the chat template ran over {CPU_S} s of processor time: it does too much work"
    return f"the chat template's worker stopped ({returncode}): it needs more memory or time than a template may use"


_worker: TemplateWorker | None = None
_worker_lock = threading.Lock()


def worker() -> TemplateWorker:
    """This process's one worker."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = TemplateWorker()
        return _worker


# ---- the worker's side ----


def main() -> None:
    """Answer requests from stdin until it closes (the caller exited), each under a renewed processor-time limit."""
    from . import chat_template

    _limit_memory()
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        _limit_cpu()
        try:
            request = json.loads(line)
            if request["messages"] is None:
                chat_template.check_template(request["template"])
                reply = {"text": ""}
            else:
                text = chat_template.render(
                    request["template"],
                    request["messages"],
                    bos_token=request["bos"],
                    eos_token=request["eos"],
                    tools=request.get("tools"),
                )
                reply = {"text": text}
        except TemplateError as exc:
            reply = {"error": str(exc)}
        except MemoryError:
            reply = {"error": f"the chat template needs over {MEMORY_BYTES // 2**20} MiB: it builds too much"}
        except Exception as exc:  # a request this module did not write: the caller's bug, still one line
            reply = {"error": f"the chat template worker failed: {first_line(exc)}"}
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()


def _limit_memory() -> None:
    try:
        with open("/proc/self/status") as status:
            held = int(status.read().split("VmSize:")[1].split()[0]) * 1024
    except OSError:  # no /proc (macOS, which does not enforce RLIMIT_AS anyway): the deadlines still hold
        return
    resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_BYTES, held + MEMORY_BYTES))


def _limit_cpu() -> None:
    """SIGXCPU (which ends the process) once this request has used CPU_S more seconds than all before it."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = spent + CPU_S
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
