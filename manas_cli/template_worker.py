"""Chat templates rendered in a worker process whose time and memory the operating system bounds (worker.py).

A template is code from a file. The checks in chat_template catch the usual hostile one at once, but they cannot
bound one step: jinja2 folds constant expressions while it compiles (`{{ "%0900000000d" % 1 }}` builds 900 MB
before any render), an integer power chain runs for minutes holding the interpreter's lock, a filter's keyword
builds a gigabyte. So every compile and render runs in the worker. A server's other requests (/health,
completions) never wait on a template; chat requests take turns, each waiting at most WALL_S for every template
render ahead of it.

A request is {"template", "messages" (null: compile only), "bos", "eos", "tools", "kwargs"}; the reply {"text"}."""

from __future__ import annotations

import threading

from .chat_template import TemplateError, require_jinja2
from .worker import Bounds, Worker, serve

BOUNDS = Bounds(
    what="the chat template",
    cpu_s=2,  # processor time per request: Llama 3.1's template renders 40 messages in about 1 ms here
    wall_s=5.0,  # the caller's deadline per request, on a busy machine too
    memory_bytes=512 * 2**20,  # address space the worker may add to what it holds at its start
    reply_bytes=16 * 2**20,  # a rendered prompt is at most 1 Mi characters (chat_template.MAX_VALUE_CHARS)
)


class TemplateWorker:
    """One worker process for this process's templates. Calls from several threads take turns (a template renders
    in milliseconds; a hostile one holds the turn WALL_S)."""

    def __init__(self) -> None:
        self._worker = Worker(__name__, BOUNDS, TemplateError)
        self._lock = threading.Lock()

    def compile(self, template: str) -> None:
        self._ask({"template": template, "messages": None, "bos": "", "eos": ""})

    def render(
        self,
        template: str,
        messages: list[dict],
        bos_token: str,
        eos_token: str,
        tools: list | None = None,
        kwargs: dict | None = None,
    ) -> str:
        return self._ask(
            {
                "template": template,
                "messages": messages,
                "bos": bos_token,
                "eos": eos_token,
                "tools": tools,
                "kwargs": kwargs,
            }
        )

    def _ask(self, request: dict) -> str:
        require_jinja2()
        with self._lock:
            return self._worker.ask(request)["text"]


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
    serve(BOUNDS, _handle, TemplateError)


def _handle(request: dict) -> dict:
    from . import chat_template

    if request["messages"] is None:
        chat_template.check_template(request["template"])
        return {"text": ""}
    text = chat_template.render(
        request["template"],
        request["messages"],
        bos_token=request["bos"],
        eos_token=request["eos"],
        tools=request.get("tools"),
        kwargs=request.get("kwargs"),
    )
    return {"text": text}
