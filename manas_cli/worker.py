"""Untrusted work (a chat template's render, a constraint's compile) in a separate, long-lived process whose time and
memory the operating system bounds.

Some input cannot be bounded by checks made before it runs: jinja2 folds a template's constant expressions while
compiling it, and a JSON Schema's `allOf` of patterns or a grammar of 10,000 chained rules makes llguidance build
gigabytes, or overflow its stack. So that work runs in a worker process under RLIMIT_AS (its memory) and
RLIMIT_CPU (its processor time, renewed per request), and the caller waits on a pipe with a wall-clock deadline: a
worker past any of the three is killed (or dies: an abort, a segmentation fault) and the next request starts a
fresh one. The caller never dies with it, and no other request waits on it beyond what its owner decides.

The protocol is one JSON line each way: the worker says {"ready": true} once started, then answers each request
line with one reply line, {"error": ...} where the work was refused."""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import first_line

START_S = 30.0  # a worker's start (Python and its imports), on a busy machine


@dataclass(frozen=True)
class Bounds:
    """What one request may use: processor time, wall-clock time (the caller's deadline), address space beyond what
    the worker held at its start, and the bytes of its reply. `what` names the work in errors ("the chat template")."""

    what: str
    cpu_s: int
    wall_s: float
    memory_bytes: int
    reply_bytes: int


class Worker:
    """The caller's side: one worker process running `module`'s main(), started on first use (then sent `greeting`,
    where given), restarted after it dies or is killed. Not thread-safe: its owner gives each caller its turn."""

    def __init__(self, module: str, bounds: Bounds, error: type[Exception], greeting: dict | None = None) -> None:
        self.module, self.bounds, self.error, self.greeting = module, bounds, error, greeting
        self._process: subprocess.Popen | None = None

    def ask(self, request: dict) -> dict:
        """The worker's reply to `request`; `error` raised with its message where the work was refused, or where the
        worker died, ran past its deadline or answered too much."""
        process = self._started()
        reply = self._exchange(process, request, self.bounds.wall_s)
        if "error" in reply:
            raise self.error(reply["error"])
        return reply

    def stop(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                pipe.close()
            self._process = None

    def _started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        root = str(Path(__file__).resolve().parent.parent)
        # -I: neither the caller's folder nor PYTHON* variables decide what the worker imports; the package is
        # found where this file is.
        code = f"import sys; sys.path.insert(0, {root!r}); from {self.module} import main; main()"
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal is the caller's to handle, not the worker's
        )
        if json.loads(self._reply(self._process, START_S)) != {"ready": True}:
            self.stop()
            raise self.error(f"{self.bounds.what}'s worker did not start")
        if self.greeting is not None:
            reply = self._exchange(self._process, self.greeting, START_S)
            if "error" in reply:
                self.stop()
                raise self.error(reply["error"])
        return self._process

    def _exchange(self, process: subprocess.Popen, request: dict, timeout_s: float) -> dict:
        try:
            process.stdin.write((json.dumps(request) + "\n").encode())
            process.stdin.flush()
        except OSError:  # killed from outside since it was started: the next request starts a fresh one
            self.stop()
            raise self.error(f"{self.bounds.what}'s worker stopped: send the request again") from None
        return json.loads(self._reply(process, timeout_s))

    def _reply(self, process: subprocess.Popen, timeout_s: float) -> str:
        """The worker's next line, or `error` when it dies, runs past timeout_s, or answers too much."""
        deadline, data = time.monotonic() + timeout_s, b""
        fd = process.stdout.fileno()
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.stop()
                raise self.error(f"{self.bounds.what} ran over {timeout_s:g} s: it does too much work")
            chunk = os.read(fd, 1 << 16)
            if not chunk or len(data) + len(chunk) > self.bounds.reply_bytes:
                died = process.poll() if chunk else process.wait()
                self.stop()
                raise self.error(self._death(died))
            data += chunk
        return data.decode()

    def _death(self, returncode: int | None) -> str:
        import signal

        what = self.bounds.what
        if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL:
            return f"{what} ran over {self.bounds.cpu_s} s of processor time: it does too much work"
        return f"{what}'s worker stopped ({returncode}): it needs more memory or time than {what} may use"


# ---- the worker's side ----


def serve(bounds: Bounds, handle: Callable[[dict], dict], refused: type[Exception]) -> None:
    """Answer requests from stdin until it closes (the caller exited), each under a renewed processor-time limit:
    handle(request) is the reply; `refused` raised by it is the reply {"error": its message}."""
    _limit_memory(bounds.memory_bytes)
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        _limit_cpu(bounds.cpu_s)
        try:
            reply = handle(json.loads(line))
        except refused as exc:
            reply = {"error": str(exc)}
        except MemoryError:
            reply = {"error": f"{bounds.what} needs over {bounds.memory_bytes // 2**20} MiB: it builds too much"}
        except Exception as exc:  # a request this package did not write: the caller's bug, still one line
            reply = {"error": f"{bounds.what}'s worker failed: {first_line(exc)}"}
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()


def _limit_memory(memory_bytes: int) -> None:
    try:
        with open("/proc/self/status") as status:
            held = int(status.read().split("VmSize:")[1].split()[0]) * 1024
    except OSError:  # no /proc (macOS, which does not enforce RLIMIT_AS anyway): the deadlines still hold
        return
    resource.setrlimit(resource.RLIMIT_AS, (held + memory_bytes, held + memory_bytes))


def _limit_cpu(cpu_s: int) -> None:
    """SIGXCPU (which ends the process) once this request has used cpu_s more seconds than all before it."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = spent + cpu_s
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
