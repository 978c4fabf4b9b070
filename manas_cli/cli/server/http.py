"""The HTTP side of `manas serve`: the standard library's threading server, one thread per connection, each
request checked (size, type, key, fields) before it reaches the engine, answers in OpenAI's shapes, streams as
server-sent events. Nothing a request sends names a file: the server reads and writes none."""

from __future__ import annotations

import hmac
import io
import queue
import select
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ...errors import ManasError, first_line
from ...records import json_line
from ...settings import GenerationSettings
from ...thinking import ThoughtSplitter, after_thought
from ...thinking import split as split_thought
from ...tools import ToolError, call_format, check_syntax, read_calls
from .api import (
    FINISH_REASONS,
    RequestError,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    choice_body,
    completion_body,
    legacy_logprobs,
    parse_chat,
    parse_completion,
    parse_json,
    tool_call_deltas,
    usage,
)
from .scheduler import Choice, Ended, QueueFull, Scheduler

MAX_BODY_BYTES = 1 << 20
DRAIN_BYTES = 8 << 20  # a body left unread (refused before it was read) is read and dropped up to this, then the
# connection closes: never parsed as the next request, and the client, still sending, gets to read the answer
CLIENT_TIMEOUT_S = 10.0  # a client that sends or reads nothing for this long is dropped (slowloris, a stalled reader);
# a request's line, headers and body must all arrive within it too, however slowly they trickle
RETRY_AFTER_S = 1
# Bodies read as JSON: JSON's own type, none, and curl's default for -d (as llama-server and ollama read them).
JSON_TYPES = ("application/json", "", "application/x-www-form-urlencoded")
POLL_S = 0.25  # how often a waiting non-streamed request looks whether its client is still there


class Server(ThreadingHTTPServer):
    """The listening socket and what every request needs: the engine, the model's name, the key; `chat`, the
    messages' prompt ids through the model's chat template (None: a base model, which has none)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 resets the 6th of many clients connecting at once

    def __init__(
        self,
        address: tuple[str, int],
        scheduler: Scheduler,
        encode,
        model_id: str,
        api_key: str | None,
        verbose: bool,
        timeout_s: float = CLIENT_TIMEOUT_S,
        max_connections: int = 256,
        max_tokens: int = 1024,
        chat=None,
        template: str | None = None,
    ) -> None:
        self.timeout_s, self.max_connections, self.max_tokens = timeout_s, max_connections, max_tokens
        self.chat, self.template = chat, template
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.scheduler, self.encode, self.model_id = scheduler, encode, model_id
        self.api_key, self.verbose = api_key, verbose
        self.created = int(time.time())
        self.active = 0  # requests being answered
        self.connections = 0  # connections open, each with its thread
        self._lock = threading.Lock()

    def track(self, change: int) -> None:
        with self._lock:
            self.active += change

    def process_request(self, request, client_address) -> None:
        """A thread for the connection, or, past --max-connections, a 503 at once and no thread: a flood of idle
        connections costs a socket each, not a thread each, and cannot lock out the clients already served."""
        with self._lock:
            admitted = self.connections < self.max_connections
            self.connections += admitted
        if admitted:
            super().process_request(request, client_address)
            return
        body = (
            json_line(
                RequestError(
                    f"the server holds {self.max_connections} connections already: retry in {RETRY_AFTER_S} s",
                    status=503,
                    kind="server_error",
                ).body()
            ).encode()
            + b"\n"
        )
        try:
            request.settimeout(0)
            request.sendall(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (RETRY_AFTER_S, len(body), body)
            )
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """One line, never socketserver's traceback: whatever a connection's thread could not answer (a client gone
        while its answer was written is answered nowhere, and not reported)."""
        error = sys.exc_info()[1]
        if not isinstance(error, (BrokenPipeError, ConnectionResetError, socket.timeout)):
            print(f"manas serve: a connection from {client_address[0]} failed: {first_line(error)}", file=sys.stderr)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self.connections -= 1


class DeadlineReader(io.RawIOBase):
    """A connection's bytes, each read bounded by what is left of the request's deadline: one byte every few
    seconds (slowloris) never resets it, as a per-read timeout would."""

    def __init__(self, connection: socket.socket, timeout_s: float) -> None:
        self.connection, self.timeout_s = connection, timeout_s
        self.deadline = time.monotonic() + timeout_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the request did not arrive in time")
        self.connection.settimeout(min(left, self.timeout_s))
        try:
            return self.connection.recv_into(buffer)
        finally:
            self.connection.settimeout(self.timeout_s)  # writes keep the per-write timeout


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def setup(self) -> None:
        self.timeout = self.server.timeout_s  # every read and write of the connection
        super().setup()
        self.reader = DeadlineReader(self.connection, self.server.timeout_s)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        """One request, which must arrive whole (line, headers, body) within the timeout from now."""
        self.reader.deadline = time.monotonic() + self.server.timeout_s
        self._unread = 0  # body bytes the request declared and no one has read
        super().handle_one_request()

    def parse_request(self) -> bool:
        """http.server's parsing, then the body's declared length: one, in digits, or the request is refused."""
        if not super().parse_request():
            return False
        lengths = set(self.headers.get_all("Content-Length") or ())
        if len(lengths) > 1 or any(not (n.isascii() and n.isdigit()) for n in lengths):
            self.close_connection = True
            self._answer(lambda: _refuse(f"Content-Length must be one count in digits, got {sorted(lengths)}", 400))
            return False
        self._unread = int(next(iter(lengths), "0"))
        return True

    # ---- routing ----

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path.startswith("/v1/models/"):
            self._answer(lambda: self._model(path.removeprefix("/v1/models/")))
        else:
            self._answer({"/health": self._health, "/v1/models": self._models}.get(path))

    def do_POST(self) -> None:
        routes = {"/v1/completions": self._completions, "/v1/chat/completions": self._chat}
        self._answer(routes.get(self.path.split("?")[0]))

    def _answer(self, route) -> None:
        self.server.track(1)
        started = time.monotonic()
        self._status, self._first_token_s = 0, None
        if self._unread and self.command != "POST":  # a body no route reads: the connection ends with the answer
            self.close_connection = True
        try:
            try:
                if route is None:
                    raise RequestError(
                        f"no route {self.command} {self.path}: manas serves GET /health, GET /v1/models, "
                        "POST /v1/completions and POST /v1/chat/completions",
                        status=404,
                        code="not_found",
                    )
                route()
            except RequestError as exc:
                if self._unread:  # a body no one read is never parsed as the next request
                    self.close_connection = True
                retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in (429, 503) else {}
                self._json(exc.status, exc.body(), retry)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):  # the client went before its answer
            self.close_connection = True
            if self._status >= 400:  # its error reply was lost: the server's operator is told, in one line
                print(f"manas serve: {self.client_address[0]} left before its {self._status} reply", file=sys.stderr)
        finally:
            if self._unread:
                self.close_connection = True
                self._drain()
            self.server.track(-1)
            if self.server.verbose:  # the first token's time is the server's clock (CLOCK_MONOTONIC, system-wide)
                first = f" · first token at {self._first_token_s:.6f}" if self._first_token_s is not None else ""
                print(
                    f'{self.client_address[0]} "{self.command} {self.path}" {self._status} '
                    f"{time.monotonic() - started:.3f} s{first}",
                    file=sys.stderr,
                    flush=True,
                )

    def log_message(self, format: str, *args) -> None:
        """http.server's own log lines stay off stderr; --verbose writes one access line per request instead."""

    # ---- endpoints ----

    def _health(self) -> None:
        scheduler = self.server.scheduler
        if failure := scheduler.failure:
            self._json(503, {"status": "error", "error": failure})
        else:
            body = {"status": "ok", "rows": scheduler.rows, "queued": scheduler.queued}
            if (prefixes := scheduler.prefixes) is not None:
                body["prefix_cache"] = {
                    "entries": len(prefixes.entries),
                    "bytes": prefixes.bytes,
                    "hits": prefixes.hits,
                    "reused_tokens": prefixes.reused_tokens,
                }
            self._json(200, body)

    def _models(self) -> None:
        self._authorize()
        self._json(200, {"object": "list", "data": [self._model_object()]})

    def _model(self, name: str) -> None:
        """GET /v1/models/{id} (the openai client's models.retrieve)."""
        self._authorize()
        if name != self.server.model_id:
            raise RequestError(
                f"no model {name!r}: this server serves {self.server.model_id!r}",
                param="model",
                status=404,
                code="model_not_found",
            )
        self._json(200, self._model_object())

    def _model_object(self) -> dict:
        return {"id": self.server.model_id, "object": "model", "created": self.server.created, "owned_by": "manas"}

    def _chat(self) -> None:
        self._authorize()
        if self.server.chat is None:
            raise RequestError(
                "this model has no chat template (a base model): send the text to continue to POST /v1/completions, "
                "or give the template with manas serve --chat-template FILE",
                status=404,
                code="not_found",
            )
        request = parse_chat(parse_json(self._body()), self.server.max_tokens)
        request, syntax = self._with_tools(request)
        tools = request.tools.listed if request.tools else None
        try:
            prompt = self.server.chat(request.messages, tools, request.template_kwargs)
        except ManasError as exc:  # the template refused these messages, or failed on them
            raise RequestError(str(exc), param="messages") from None
        request = self._after_thought(request, prompt)
        if syntax is not None and request.tools.choice != "none":
            self._run(request, [prompt.ids], partial(ToolReply, syntax=syntax))
        else:
            self._run(request, [prompt.ids], ChatReply)

    def _after_thought(self, request, prompt):
        """A thinking model's request (thinking.py): its answers split into thought and reply, and the grammar of a
        response_format, json_schema or tools put after the thought, so that it constrains the reply alone (a
        `grammar` constrains the whole answer, as written)."""
        if not prompt.thinks:
            return request
        format = request.settings.format
        if format is not None and request.format_field in ("response_format", "json_schema", "tools"):
            special = self.server.scheduler.requests.encoding.special_tokens_set
            settings = replace(request.settings, format=after_thought(format, prompt.thought, special))
            request = replace(request, settings=settings)
        return replace(request, thought=prompt.thought)

    def _with_tools(self, request):
        """A chat request with tools constrained to the model's call syntax (tools.py), and that syntax; as it is,
        and None, without tools. A 400 naming `tools` for a model whose template takes none."""
        if request.tools is None:
            return request, None
        try:
            syntax = check_syntax(self.server.template)
        except ToolError as exc:
            raise RequestError(str(exc), param=exc.param) from None
        format = call_format(request.tools, syntax, self.server.scheduler.requests.encoding.special_tokens_set)
        settings = GenerationSettings(**{**request.settings.__dict__, "format": format})
        return replace(request, settings=settings, format_field="tools" if format else None), syntax

    def _completions(self) -> None:
        self._authorize()
        request = parse_completion(parse_json(self._body()), self.server.max_tokens)
        try:
            prompts = [self.server.encode(prompt, special=request.settings.parse_special) for prompt in request.prompts]
        except ManasError as exc:  # a character outside a character-level vocabulary, an empty prompt
            raise RequestError(str(exc), param="prompt") from None
        self._run(request, prompts, Reply)

    def _run(self, request, prompts: list[list[int]], reply_class: type[Reply]) -> None:
        """Each prompt's n choices into the batch, then the answer: streamed, or whole when every choice is done."""
        if failure := self.server.scheduler.failure:
            raise RequestError(failure, status=500, kind="server_error")
        grammar = self._grammar(request)
        events: queue.Queue = queue.Queue()
        choices = []
        for p, ids in enumerate(prompts):
            for i in range(request.n):
                settings = request.settings
                if settings.seed is not None and i:  # choice i of a seeded request is `generate --seed S+i` alone
                    settings = type(settings)(**{**settings.__dict__, "seed": (settings.seed + i) % 2**64})
                try:
                    choice = self.server.scheduler.new_choice(p * request.n + i, ids, settings, grammar)
                except ManasError as exc:  # speculation this server cannot run as asked
                    raise RequestError(str(exc), param="speculative") from None
                choice.events = events
                choices.append(choice)
        try:
            self.server.scheduler.submit(choices)
        except QueueFull as exc:
            raise RequestError(
                f"the server is busy ({exc}): retry in {RETRY_AFTER_S} s",
                status=429,
                kind="rate_limit_error",
                code="rate_limit_exceeded",
            ) from None
        try:
            reply = reply_class(request, prompts, choices, self.server)
            if request.stream:
                self._stream(reply, events)
            else:
                self._wait(events, len(choices))
                if failure := self.server.scheduler.failure:
                    raise RequestError(failure, status=500, kind="server_error")
                if failed := next((c for c in choices if c.error), None):
                    raise RequestError(failed.error, status=failed.error_status, kind="server_error")
                self._json(200, reply.body())
        finally:
            for choice in choices:  # a client gone mid-answer frees its rows at the engine's next step
                choice.cancelled = choice.cancelled or not choice.stream.finished
            self._first_token_s = min((c.first_token_s for c in choices if c.first_token_s is not None), default=None)

    def _grammar(self, request):
        """The request's structured output compiled for the model (structured.Grammar), or None; a 400 naming the
        field that asked for it when it cannot be compiled, or llguidance is not installed."""
        try:
            return self.server.scheduler.requests.grammar(request.settings.format, request.format_field or "")
        except ManasError as exc:
            raise RequestError(str(exc), param=request.format_field) from None

    # ---- the request, checked ----

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {key}"
        if not hmac.compare_digest(
            given.encode(), expected.encode()
        ):  # constant time: the key is not guessed byte by byte
            raise RequestError(
                "a wrong or missing API key: send Authorization: Bearer <key>", status=401, code="invalid_api_key"
            )

    def _body(self) -> bytes:
        kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind not in JSON_TYPES:
            raise RequestError(f"the body must be application/json, not {kind}", status=415)
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise RequestError("send the body with a Content-Length, not chunked", status=411)
        length = self.headers.get("Content-Length")  # parse_request checked it is one count in digits
        if length is None:
            self.close_connection = True
            raise RequestError("a POST needs a Content-Length header", status=411)
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the body is {int(length):,} bytes: at most {MAX_BODY_BYTES:,}", status=413)
        body = self.rfile.read(int(length))
        self._unread = 0
        if len(body) < int(length):
            self.close_connection = True
            raise RequestError(f"the body ended after {len(body)} of its {length} bytes")
        return body

    def _drain(self) -> None:
        """Read and drop the body no one read (up to DRAIN_BYTES, within the request's deadline), so that the
        client, which may still be sending it, reads the answer before the connection closes."""
        left, self._unread = min(self._unread, DRAIN_BYTES), 0
        try:
            while left > 0 and (chunk := self.rfile.read1(min(left, 1 << 16))):
                left -= len(chunk)
        except OSError:
            pass

    # ---- answering ----

    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = (json_line(body) + "\n").encode()
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _wait(self, events: queue.Queue, count: int) -> None:
        """Until every choice is done; a client that hangs up meanwhile stops waiting (its rows are freed). Looked
        for every POLL_S whether tokens arrive or not: a busy request's events never leave the queue empty."""
        ended, look_at = 0, time.monotonic() + POLL_S
        while ended < count:
            try:
                ended += isinstance(events.get(timeout=POLL_S), Ended)
            except queue.Empty:
                pass
            if time.monotonic() >= look_at:
                if self._client_gone():
                    raise ConnectionResetError("the client hung up") from None
                look_at = time.monotonic() + POLL_S

    def _client_gone(self) -> bool:
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _stream(self, reply: Reply, events: queue.Queue) -> None:
        self._status = 200
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's
        self.end_headers()
        self.close_connection = True
        for body in reply.opening():
            self._event(body)
        ended = 0
        while ended < len(reply.choices):
            event = events.get()
            if isinstance(event, Ended):
                ended += 1
                choice = reply.choice(event.index)
                if choice.error is not None:  # this choice failed or was cut; the others go on
                    self._event(RequestError(choice.error, status=choice.error_status, kind="server_error").body())
                else:
                    for body in reply.closing(event.index):
                        self._event(body)
            elif event.text or event.entry is not None:
                logprobs = reply.stream_logprobs(event.index, event.text, event.entry)
                for body in reply.delta(event.index, event.text, logprobs):
                    self._event(body)
        if reply.request.include_usage:
            self._event({**reply.chunk(0, "", None, None), "choices": [], "usage": reply.usage()})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, body: dict) -> None:
        self.wfile.write(f"data: {json_line(body)}\n\n".encode())
        self.wfile.flush()


class Reply:
    """One request's answer, built from its choices as they finish: bodies, stream chunks, usage."""

    def __init__(self, request, prompts: list[list[int]], choices: list[Choice], server: Server) -> None:
        self.request, self.prompts, self.choices = request, prompts, choices
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.model, self.created = server.model_id, int(time.time())
        self._offsets = {choice.index: len(self.prompt_text(choice)) if request.echo else 0 for choice in choices}

    def choice(self, index: int) -> Choice:
        return self.choices[index]

    def opening(self) -> list[dict]:
        """The chunks a stream starts with: with echo, each choice's prompt."""
        if not self.request.echo:
            return []
        return [self.chunk(choice.index, self.prompt_text(choice), None, None) for choice in self.choices]

    def prompt_text(self, choice: Choice) -> str:
        return self.request.prompts[choice.index // self.request.n]

    def finish_reason(self, choice: Choice) -> str:
        return FINISH_REASONS.get(choice.stream.finish_reason, "length")

    def usage(self) -> dict:
        speculated = None
        if any(choice.request.proposer is not None for choice in self.choices):
            speculated = (sum(c.proposed_tokens for c in self.choices), sum(c.accepted_tokens for c in self.choices))
        return usage(
            sum(len(ids) for ids in self.prompts), sum(choice.stream.count for choice in self.choices), speculated
        )

    def body(self) -> dict:
        choices = []
        for choice in self.choices:
            text = (self.prompt_text(choice) if self.request.echo else "") + choice.stream.text
            offset = len(self.prompt_text(choice)) if self.request.echo else 0
            logprobs = legacy_logprobs(choice.stream.logprobs, offset) if self.request.settings.logprobs else None
            choices.append(choice_body(choice.index, text, self.finish_reason(choice), logprobs))
        return completion_body(self.id, self.created, self.model, choices, self.usage())

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return completion_body(
            self.id, self.created, self.model, [choice_body(index, text, finish_reason, logprobs)], None
        )

    def delta(self, index: int, text: str, logprobs: dict | None) -> list[dict]:
        """The stream's chunks for text a choice released."""
        return [self.chunk(index, text, None, logprobs)]

    def closing(self, index: int) -> list[dict]:
        """The stream's chunks once a choice has finished."""
        return [self.chunk(index, "", self.finish_reason(self.choice(index)), None)]

    def stream_logprobs(self, index: int, text: str, entry: dict | None) -> dict | None:
        """A chunk's token's logprobs, in the legacy shape, its offset counted along the choice's tokens."""
        if not self.request.settings.logprobs or entry is None:
            return None
        logprobs = legacy_logprobs([entry], self._offsets[index])
        self._offsets[index] += len(entry["text"])
        return logprobs


class ChatReply(Reply):
    """A chat request's answer: the assistant's message, chunks of `delta`, OpenAI's chat logprobs. A thinking
    model's thought comes apart from its reply, as reasoning_content (streamed as delta.reasoning_content)."""

    def __init__(self, request, prompts: list[list[int]], choices: list[Choice], server: Server) -> None:
        self.request, self.prompts, self.choices = request, prompts, choices
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model, self.created = server.model_id, int(time.time())
        self.thinks = request.thought is not None
        self._splitters = {choice.index: ThoughtSplitter(request.thought) for choice in choices} if self.thinks else {}

    def split(self, choice: Choice) -> tuple[str | None, str]:
        """A whole answer's thought (None: it had none) and reply."""
        if not self.thinks:
            return None, choice.stream.text
        return split_thought(choice.stream.text, self.request.thought)

    def opening(self) -> list[dict]:
        """Each choice's first chunk names the role, as OpenAI's do."""
        return [
            chat_chunk(self.id, self.created, self.model, c.index, {"role": "assistant", "content": ""}, None, None)
            for c in self.choices
        ]

    def body(self) -> dict:
        choices = []
        for choice in self.choices:
            thought, reply = self.split(choice)
            finish, logprobs = self.finish_reason(choice), self._logprobs(choice.stream)
            choices.append(chat_choice(choice.index, reply, finish, logprobs, thinks=self.thinks, reasoning=thought))
        return completion_body(self.id, self.created, self.model, choices, self.usage(), "chat.completion")

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return chat_chunk(self.id, self.created, self.model, index, delta, finish_reason, logprobs)

    def delta(self, index: int, text: str, logprobs: dict | None) -> list[dict]:
        if not self.thinks:
            return super().delta(index, text, logprobs)
        chunk = self._thought_chunk(index, *self._splitters[index].feed(text), logprobs)
        return [chunk] if chunk["choices"][0]["delta"] else []  # text held back (a tag begun) waits

    def closing(self, index: int) -> list[dict]:
        held = [self._thought_chunk(index, *self._splitters[index].finish(), None)] if self.thinks else []
        return [chunk for chunk in held if chunk["choices"][0]["delta"]] + super().closing(index)

    def _thought_chunk(self, index: int, thought: str, reply: str, logprobs: dict | None) -> dict:
        """A chunk of a thinking model's stream: the thought's text as reasoning_content, the reply's as content
        (an empty content where neither has any yet: the token's logprobs still come)."""
        delta = ({"reasoning_content": thought} if thought else {}) | ({"content": reply} if reply else {})
        if not delta and logprobs is not None:
            delta = {"content": ""}
        return chat_chunk(self.id, self.created, self.model, index, delta, None, logprobs)

    def stream_logprobs(self, index: int, text: str, entry: dict | None) -> dict | None:
        if self.request.top_logprobs is None or entry is None:
            return None
        return chat_logprobs([entry], self.request.top_logprobs)

    def _logprobs(self, stream) -> dict | None:
        top = self.request.top_logprobs
        return None if top is None else chat_logprobs(stream.logprobs, top)


class ToolReply(ChatReply):
    """A chat answer that may call tools (tools.py): the calls read from each choice's whole text, as
    message.tool_calls with finish_reason "tool_calls"; a stream holds a choice's text back until it has finished
    (only then is it known to be a call or text), then sends the calls as OpenAI's tool_calls deltas, or the text."""

    def __init__(self, request, prompts: list[list[int]], choices: list[Choice], server: Server, syntax: str) -> None:
        super().__init__(request, prompts, choices, server)
        self.syntax = syntax
        self._read: dict[int, object] = {}

    def read(self, choice: Choice):
        """The calls in the answer's reply (after any thought)."""
        if choice.index not in self._read:
            self._read[choice.index] = read_calls(self.split(choice)[1], self.syntax, self.request.tools)
        return self._read[choice.index]

    def finish_reason(self, choice: Choice) -> str:
        called = choice.stream.finish_reason == "end_of_text" and self.read(choice).calls
        return "tool_calls" if called else super().finish_reason(choice)

    def body(self) -> dict:
        choices = []
        for choice in self.choices:
            answer, thought = self.read(choice), self.split(choice)[0]
            finish, logprobs = self.finish_reason(choice), self._logprobs(choice.stream)
            body = chat_choice(choice.index, answer.content, finish, logprobs, thinks=self.thinks, reasoning=thought)
            if answer.calls:
                body["message"]["tool_calls"] = answer.calls
            choices.append(body)
        return completion_body(self.id, self.created, self.model, choices, self.usage(), "chat.completion")

    def delta(self, index: int, text: str, logprobs: dict | None) -> list[dict]:
        return []

    def closing(self, index: int) -> list[dict]:
        answer, chunks = self.read(self.choice(index)), []
        if thought := self.split(self.choice(index))[0]:
            chunks.append(self._thought_chunk(index, thought, "", None))
        if answer.content:
            chunks.append(self.chunk(index, answer.content, None, None))
        for delta in tool_call_deltas(answer.calls):
            chunks.append(chat_chunk(self.id, self.created, self.model, index, delta, None, None))
        return [*chunks, self.chunk(index, "", self.finish_reason(self.choice(index)), None)]


def serve(server: Server, grace_s: float, on_ready) -> None:
    """Serve until SIGINT or SIGTERM (KeyboardInterrupt here); then stop accepting, let what runs finish within
    grace_s, cancel the rest, and return. A second signal during the grace period propagates (exit 130)."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    server.scheduler.start()
    try:
        on_ready()  # before the port accepts (it listens already: a client waits in the backlog); inside the try: a
        thread.start()  # signal right after the ready line is the graceful stop too
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        pass
    handlers = {number: signal.signal(number, _interrupt_now) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        if thread.ident is not None:  # (a signal may come between the ready line and the start)
            server.shutdown()  # no new connections; the handlers already running go on
        server.scheduler.stop()
        deadline = time.monotonic() + grace_s
        while (server.active or server.scheduler.busy) and time.monotonic() < deadline:
            time.sleep(0.05)
        server.scheduler.cancel_all()
        server.scheduler.join(timeout=grace_s)
        server.server_close()
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def _refuse(message: str, status: int) -> None:
    raise RequestError(message, status=status)


def _interrupt_now(signum: int, frame) -> None:
    """A second signal during the grace period: what runs is not waited for."""
    raise KeyboardInterrupt()
