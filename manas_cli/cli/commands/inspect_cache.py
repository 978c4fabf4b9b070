"""`manas inspect-cache`: prefill a prompt (and decode more), then show what the KV cache holds."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..flags import JsonOption, PromptFileOption, PromptOption, takes_model_flags

if TYPE_CHECKING:
    from ...models import ModelOptions


DEFAULT_PROMPT = "ROMEO:\nWhat light through yonder window breaks?"


def run(
    *, prompt: str | None, prompt_file: Path | None, tokens: int, json_output: bool, model_options: "ModelOptions"
) -> None:
    from ...engine.generation import GenerationStats, generate, prompt_batch
    from ...engine.sampling import Sampler
    from ...engine.session import cache_report
    from ...records import json_line
    from ...requests import encode_prompt
    from ..render import cache_view, stderr_console, token_progress
    from .common import check_memory, load_model, read_prompt, require_stdout

    require_stdout()
    console = stderr_console()
    text = read_prompt(prompt, prompt_file, default=DEFAULT_PROMPT)
    checkpoint, _, engine = load_model(model_options, console)
    model = checkpoint.model
    ids = encode_prompt(checkpoint, text, console.print)
    positions = min(model.config.block_size, len(ids) + tokens)
    check_memory(engine, 1, positions, "--tokens")
    session = engine.new_session(model_options.cache, capacity=positions)
    stats = GenerationStats(prompt_tokens=len(ids), re_prefill_positions=[])
    if tokens == 0:
        session.prefill(prompt_batch(ids, 1))
    else:
        # The prompt's prefill yields the first new token; the remaining tokens decode from the cache.
        steps = generate(engine, prompt_batch(ids, 1), Sampler(temperature=0.0), tokens + 1, session=session)
        with token_progress(console, tokens + 1, "decoding") as advance:
            for step in steps:
                stats.update(step)
                advance()
    report = cache_report(session)
    report["re_prefill_positions"] = stats.re_prefill_positions
    config = model.config
    header = {
        "checkpoint": str(checkpoint.path),
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_kv_head": config.n_kv_head,
        "head_size": config.head_size,
        "device": engine.device,
        "weights": engine.weights,
        "weights_bytes": engine.weights_bytes,
        "engine": engine.name,
        "prompt_tokens": len(ids),
        "decoded_tokens": tokens,
    }
    if json_output:
        print(json_line({**report, **header}))
        return
    from rich.console import Console

    Console(highlight=False, no_color=console.no_color, soft_wrap=True).print(cache_view(report, header))


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags()
def command(
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", min=0, help="Greedy tokens to decode after the prompt.")] = 0,
    json_output: JsonOption = False,
    *,
    model_options: "ModelOptions",
) -> None:
    """Prefill a prompt (and decode --tokens more), then show what the KV cache holds.

    Positions, per-layer K/V shapes, logical and allocated bytes, the size at a full window, and what grouped-query
    attention saves against a plain multi-head cache. Without a prompt, a short default one is used.

    Examples:

      manas inspect-cache

      manas inspect-cache -p 'ROMEO:' --tokens 300

      manas inspect-cache --json | jq .layers
    """

    run(prompt=prompt, prompt_file=prompt_file, tokens=tokens, json_output=json_output, model_options=model_options)
