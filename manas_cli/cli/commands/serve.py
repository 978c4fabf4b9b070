"""`manas serve`: OpenAI's completions API on a local port, every request a row of one continuous batch."""

import errno
import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...errors import InputError
from ..flags import DraftMaxOption, DraftModelOption, LookupOption, takes_model_flags

if TYPE_CHECKING:
    from ...models import ModelOptions


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
    model_options: "ModelOptions",
    max_connections: int | None = None,
    max_tokens: int | None = None,
    chat_template: Path | None = None,
    prefix_cache_mb: float = 0,
    lookup: int | None = None,
    draft_model: Path | None = None,
    draft_max: int = 4,
) -> None:
    from ...engine.memory import fitting_window
    from ...models import model_name
    from ...requests import encode_prompt
    from ..render import say, stderr_console
    from ..server.http import Server, serve
    from ..server.scheduler import Scheduler
    from .common import chat_template_text, check_memory, load_model, model_chat_template, speculation

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
    draft, speculative = speculation(lookup, draft_model, draft_max, model_options, checkpoint, engine)
    if draft is not None:  # each row's draft keeps a cache of its own, up to the draft's window
        check_memory(draft, batch_size, draft.config.block_size, "--batch-size (each row has a draft cache too)")
    scheduler = Scheduler(
        engine, checkpoint, batch_size, max_queued, prefix_cache_bytes=int(prefix_cache_mb * 2**20), draft=draft,
        speculative=speculative,
    )  # fmt: skip
    model_id = model_name(model_options.checkpoint)
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
            template=template,
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


def chat_prompt(template: str, checkpoint, messages, tools: list | None = None, kwargs: dict | None = None):
    """The messages' (and tools', and template variables') prompt through the template (chat.Prompt), its ids
    cropped to the window as a completion's prompt is."""
    from ...chat import render_prompt

    prompt = render_prompt(template, messages, checkpoint.encoding, tools, kwargs)
    return replace(prompt, ids=prompt.ids[-checkpoint.model.config.block_size :])


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags(cache=False)
def command(
    host: Annotated[
        str,
        typer.Option(
            help=(
                "Address to listen on. Another than loopback without --api-key prints a warning: anyone who reaches "
                "the port can use the model."
            )
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on; 0 takes a free one (the ready line says which).")
    ] = 8080,
    batch_size: Annotated[
        int,
        typer.Option(
            min=1, max=256, help="Requests (choices) decoded together, each at its own position, as --jsonl's."
        ),
    ] = 16,
    max_queue: Annotated[
        int, typer.Option(min=1, help="Choices that may wait for a row; beyond, a request gets 429 with Retry-After.")
    ] = 64,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            envvar="MANAS_API_KEY",
            show_envvar=True,
            help="Require 'Authorization: Bearer KEY' on every request but /health.",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help=(
                "Seconds a client may send or read nothing before it is dropped (a slow or stalled client holds no "
                "row); a request's headers and body must arrive whole within it too."
            ),
        ),
    ] = 10.0,
    max_connections: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            max=65536,
            help=(
                "Connections held at once, each with a thread; beyond, a new one gets 503 at once. Default: 32 per "
                "core, 64 to 512."
            ),
        ),
    ] = None,
    max_tokens: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help=(
                "The most tokens a choice may ask for (max_tokens); above it, 400 naming this limit. Default: 4 "
                "windows of the model, at least 1,024."
            ),
        ),
    ] = None,
    chat_template: Annotated[
        Optional[Path],
        typer.Option(
            help="A Jinja chat template for a model without one (a converted instruct model carries its own): "
            "POST /v1/chat/completions renders the messages through it."
        ),
    ] = None,
    prefix_cache_mb: Annotated[
        float,
        typer.Option(
            min=0,
            help="Memory for the exact prefix cache (native engine): a prompt that starts as a recent one did (a "
            "shared system prompt, a chat's earlier turns and answers) copies that start's K/V and prefills only the "
            "rest, its answer unchanged bit for bit; least recently used out first. 0 turns it off.",
        ),
    ] = 256,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="One access line per request on stderr.")] = False,
    lookup: LookupOption = None,
    draft_model: DraftModelOption = None,
    draft_max: DraftMaxOption = 4,
    *,
    model_options: "ModelOptions",
) -> None:
    """Serve OpenAI's completions and chat API on a local port: any client that speaks it can use the model.

    POST /v1/completions (stream, n, stop, seed, logprobs, echo, the penalties, and manas's top_k, min_p,
    repetition_penalty, repeat_last_n); POST /v1/chat/completions for a model with a chat template (messages,
    stream, n, stop, seed, logprobs and top_logprobs); both take manas's `speculative` ({"lookup": N}, {"draft":
    true}) and OpenAI's `prediction`, the same answer, faster where guesses are kept; GET /v1/models and /v1/models/{id}; GET /health. Every
    request joins one continuous batch, and its answer equals `manas generate --json` for that request alone. A base
    model has no chat template: /v1/chat/completions answers 404 unless --chat-template gives one. Ctrl-C or
    SIGTERM: stop accepting, let what runs finish (10 s), exit 0.

    Examples:

      manas serve --port 8080

      curl -s localhost:8080/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "ROMEO:", "max_tokens": 40}'
    """  # noqa: E501 (an example a user copies whole)

    run(
        host=host,
        port=port,
        batch_size=batch_size,
        max_queued=max_queue,
        api_key=api_key,
        timeout_s=timeout,
        verbose=verbose,
        max_connections=max_connections,
        max_tokens=max_tokens,
        chat_template=chat_template,
        prefix_cache_mb=prefix_cache_mb,
        model_options=model_options,
        lookup=lookup,
        draft_model=draft_model,
        draft_max=draft_max,
    )
