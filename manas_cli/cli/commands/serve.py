"""`manas serve`: OpenAI's completions API on a local port, every request a row of one continuous batch."""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from functools import partial
from pathlib import Path

import typer

from ...chat import prompt_ids
from ...engine.memory import fitting_window
from ...errors import InputError
from ...models import ModelOptions
from ...requests import encode_prompt
from .common import chat_template_text, check_memory, load_model, model_chat_template

# A choice's default ceiling on new tokens (serve --max-tokens): 4 windows, at least 1,024.
DEFAULT_MAX_TOKENS_WINDOWS, MIN_MAX_TOKENS = 4, 1024
GRACE_S = 10.0  # after SIGINT/SIGTERM, what runs has this long to finish
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # the hosts that need no warning without a key


def default_max_tokens(block_size: int) -> int:
    return max(MIN_MAX_TOKENS, DEFAULT_MAX_TOKENS_WINDOWS * block_size)


def default_max_connections() -> int:
    """32 connections a core, 64 to 512: each holds a thread while it is open."""
    return max(64, min(512, 32 * (os.cpu_count() or 1)))


def run(
    *,
    host: str,
    port: int,
    batch_size: int,
    max_queued: int,
    api_key: str | None,
    timeout_s: float,
    verbose: bool,
    model_options: ModelOptions,
    max_connections: int | None = None,
    max_tokens: int | None = None,
    chat_template: Path | None = None,
    prefix_cache_mb: float = 0,
) -> None:
    from ..render import say, stderr_console
    from ..server.http import Server, serve
    from ..server.scheduler import Scheduler

    if api_key is None and os.environ.get("MANAS_API_KEY") == "":  # typer takes an empty variable for an unset one
        api_key = ""
    if api_key is not None and not api_key.strip():
        raise InputError(
            "the API key (--api-key or $MANAS_API_KEY) is empty: give a key, or leave both unset to serve without one"
        )
    console = stderr_console()
    template = chat_template_text(chat_template)  # a bad file is refused before the model loads
    checkpoint, _, engine = load_model(model_options, console)
    window_note = ""
    if model_options.ctx is None and (window := fitting_window(engine, batch_size)) is not None:
        # The model's window does not fit the free memory: keep the longest that does, rather than refuse a default
        # the user did not choose (llama-server and ollama start with a context of their own too).
        declared = checkpoint.model.config.block_size
        checkpoint, _, engine = load_model(replace(model_options, ctx=window))
        window_note = f" · window {window:,} of {declared:,} tokens, to fit the free memory (--ctx sets it)"
    template = template or model_chat_template(checkpoint)
    check_memory(engine, batch_size, checkpoint.model.config.block_size, "--batch-size")
    scheduler = Scheduler(engine, checkpoint, batch_size, max_queued, prefix_cache_bytes=int(prefix_cache_mb * 2**20))
    model_id = checkpoint.path.stem
    try:
        server = Server(
            (host, port),
            scheduler,
            partial(encode_prompt, checkpoint),
            model_id,
            api_key,
            verbose,
            timeout_s,
            max_connections or default_max_connections(),
            max_tokens or default_max_tokens(checkpoint.model.config.block_size),
            chat=None if template is None else partial(chat_prompt, template, checkpoint),
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise InputError(
                f"cannot listen on {host}:{port}: the port is in use; choose another with --port"
            ) from None
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if host not in LOOPBACK and api_key is None:
        say(
            console, f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model"
        )
    url = f"http://{f'[{host}]' if ':' in host else host}:{server.server_port}"
    try:
        serve(
            server,
            GRACE_S,
            on_ready=lambda: say(
                console,
                f"manas serve: {url}/v1 · model {model_id} · {engine.name} engine · batch size {batch_size}"
                + window_note
                + (" · chat" if template else ""),
            ),
        )
    except KeyboardInterrupt:  # a second SIGINT or SIGTERM during the grace period: stop now
        raise typer.Exit(130) from None


def chat_prompt(template: str, checkpoint, messages) -> list[int]:
    """The messages' prompt ids through the template, cropped to the window as a completion's prompt is."""
    return prompt_ids(template, messages, checkpoint.encoding)[-checkpoint.model.config.block_size :]
