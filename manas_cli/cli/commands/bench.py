"""`manas bench`: prefill and decode speed, and the KV cache's speed-up over crop-and-recompute."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..flags import (
    DraftMaxOption,
    DraftMinOption,
    DraftModelOption,
    JsonOption,
    LookupOption,
    Overflow,
    PromptFileOption,
    takes_model_flags,
)

if TYPE_CHECKING:
    from ...models import ModelOptions


DEFAULT_PROMPT_TOKENS = 128
DEFAULT_MAX_TOKENS = 256


def bench_lengths(
    block_size: int, prompt_tokens: int | None, tokens: int | None, console, depth: int = 0
) -> tuple[int, int]:
    """The prompt and decode lengths: by default both fit in the window after the depth (the figure is then the
    cached path's, as a user's short generation sees it); a prompt longer than the window is cropped, with a
    notice, and a run that passes the window is said to re-prefill."""
    from ..render import say

    if depth >= block_size:
        raise typer.BadParameter(
            f"--depth {depth} leaves no room in the model's {block_size}-token window", param_hint="'--depth'"
        )
    room = block_size - depth
    if prompt_tokens is None:
        prompt_tokens = min(DEFAULT_PROMPT_TOKENS, max(1, room // 2))
    elif prompt_tokens > room:
        limit = (
            f"the {room} positions --depth {depth} leaves of the model's block_size"
            if depth
            else "the model's block_size"
        )
        say(
            console,
            f"notice: --prompt-tokens {prompt_tokens} is more than {limit}: prefilling {room}, the whole window",
        )
        prompt_tokens = room
    if tokens is None:
        return prompt_tokens, max(1, min(DEFAULT_MAX_TOKENS, room - prompt_tokens))
    if depth + prompt_tokens + tokens > block_size + 1:
        say(
            console,
            f"notice: {depth + prompt_tokens} prompt tokens and {tokens} new ones pass the {block_size}-token "
            "window: the decode figure includes its re-prefills (see --overflow)",
        )
    return prompt_tokens, tokens


def run(
    *,
    tokens: int | None,
    prompt_tokens: int | None,
    repeat: int,
    batch: int,
    baseline: bool | None,
    overflow: str,
    sweep: bool,
    json_output: bool,
    model_options: "ModelOptions",
    depth: int = 0,
    prompt: str | None = None,
    prompt_file: Path | None = None,
    lookup: int | None = None,
    draft_model: Path | None = None,
    draft_max: int = 4,
    draft_min: int = 0,
) -> None:
    from ...engine.bench import Speculation, run_bench
    from ...engine.bench import sweep as sweep_positions
    from ...engine.sampling import Sampler
    from ...models import resolve_checkpoint
    from ...records import json_line
    from ...requests import Requests, encode_prompt
    from ..render import BenchRows, is_noisy, noise_warning, say, stderr_console, sweep_chart, token_progress
    from .common import check_memory, load_model, read_prompt, require_stdout, speculation

    require_stdout()
    console = stderr_console()
    checkpoint, threads, engine = load_model(model_options, console)
    model = checkpoint.model
    block_size = model.config.block_size
    given = prompt is not None or prompt_file is not None
    ids = encode_prompt(checkpoint, read_prompt(prompt, prompt_file), console.print) if given else None
    if ids is not None and prompt_tokens is None:
        prompt_tokens = len(ids)
    prompt_tokens, tokens = bench_lengths(block_size, prompt_tokens, tokens, console, depth)
    draft, speculative = speculation(lookup, draft_model, draft_max, model_options, checkpoint, engine, batch)
    if speculative is not None and depth:
        raise typer.BadParameter("the speculative test decodes from its prompt: drop --depth", param_hint="'--depth'")
    timed_speculation = None
    if speculative is not None:
        make = Requests(engine, checkpoint.encoding, draft).proposer(speculative, Sampler(temperature=0.0), 1)
        timed_speculation = Speculation(f"lookup{lookup}" if lookup else "draft", make, draft_max, draft_min)
    baseline = False if baseline is None and depth else baseline
    positions = min(block_size, depth + prompt_tokens + tokens)
    check_memory(engine, batch, positions, "--batch (or --depth, --prompt-tokens, --tokens)")
    info = {
        "path": str(resolve_checkpoint(model_options.checkpoint)),  # the file the user gave, not a GGUF's conversion
        "parameters": model.num_parameters(),
        "size_bytes": engine.weights_bytes,
        "block_size": block_size,
        "device": engine.device,
        "dtype": engine.dtype,
        "threads": engine.threads,
        "threads_rule": threads.rule,
        "weights": engine.weights,
        "weights_bytes": engine.weights_bytes,
        "engine": engine.name,
    }
    report = {"model": info, "tests": [], "batch": batch, "depth": depth, "repeat": repeat, "overflow": overflow}
    rows = None if json_output else BenchRows(report, prompt_tokens, tokens)

    def measured(measurement) -> None:
        test = {"name": measurement.name, "tokens_per_s_mean": measurement.mean, "tokens_per_s_std": measurement.std}
        report["tests"].append({**test, "runs": measurement.tokens_per_s, "noisy": is_noisy(test)})
        if rows is not None:
            rows.row(report["tests"][-1])

    # Each test's warm-up run and its timed runs; with --depth the prefill test is a run of its own, one token long.
    tests = (1 if baseline is False else 2) + (timed_speculation is not None)
    steps = (repeat + 1) * (tokens * tests + (1 if depth else 0))
    try:
        with token_progress(console, steps, "warming up") as advance:
            result = run_bench(
                engine, prompt_tokens, tokens, repeat, batch, baseline, model_options.cache, overflow, advance, depth,
                on_measurement=measured, speculation=timed_speculation, prompt_ids=ids,
            )  # fmt: skip
    except KeyboardInterrupt:  # the rows measured stay printed (a JSON report holds them, marked interrupted)
        if json_output and report["tests"]:
            print(json_line({**report, "interrupted": True}))
        raise
    if result.baseline_estimate_s is not None:
        say(
            console,
            f"notice: no uncached baseline: it would take about {result.baseline_estimate_s / 60:.0f} min on this "
            "model; --baseline runs it",
        )
    sweep_rows = None
    if sweep:
        sweep_tokens = block_size + block_size // 2
        with token_progress(console, sweep_tokens, "sweeping decode speed across the window") as advance:
            sweep_rows = sweep_positions(
                engine, min(prompt_tokens, block_size // 8), sweep_tokens, 12, on_token=advance
            )
    report |= {
        "ttft_s": result.ttft_s,
        "speedup": result.speedup,
        "re_prefills": result.re_prefills,
        "peak_memory_bytes": result.peak_memory_bytes,
        "cache_bytes": result.cache_bytes,
    }
    if result.speculation is not None:
        plain, fast = report["tests"][1], report["tests"][2]
        report["speculation"] = result.speculation | {"speedup": fast["tokens_per_s_mean"] / plain["tokens_per_s_mean"]}
    if sweep_rows is not None:
        report["sweep"] = sweep_rows
    if warning := noise_warning(report):
        console.print(warning)
    if json_output:
        print(json_line(report))
        return
    rows.footer(report)
    if sweep_rows is not None:
        from rich.console import Console

        Console(highlight=False, no_color=console.no_color, soft_wrap=True).print(sweep_chart(sweep_rows))


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags()
def command(
    tokens: Annotated[
        Optional[int],
        typer.Option(
            "--tokens",
            "-n",
            min=1,
            help=(
                "New tokens to decode per run (tgN). Default: what fits in the window after the prompt, at most 256, "
                "so the figure is the cached path's (a longer run re-prefills past the window: see --overflow, "
                "--sweep)."
            ),
            show_default=False,
        ),
    ] = None,
    prompt_tokens: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help=(
                "Prompt length for the prefill test (ppP), at most block_size. Default: 128, or half the window if "
                "that is less."
            ),
            show_default=False,
        ),
    ] = None,
    repeat: Annotated[
        int, typer.Option("--repeat", "-r", min=1, help="Timed runs of each test, after one warm-up.")
    ] = 3,
    batch: Annotated[int, typer.Option(min=1, help="Rows decoded together.")] = 1,
    baseline: Annotated[
        Optional[bool],
        typer.Option(
            "--baseline/--no-baseline",
            help=(
                "Also time uncached crop-and-recompute decoding. Default: without --depth, and where it is estimated "
                "at a minute at most (on a large model it takes half an hour; --baseline runs it anyway)."
            ),
            show_default=False,
        ),
    ] = None,
    depth: Annotated[
        int,
        typer.Option(
            "--depth",
            "-d",
            min=0,
            help=(
                "Tokens already in the cache before each test, as llama-bench's -d (a long chat's later turns): "
                "the prefill test times the prompt after them, the decode test decodes after them."
            ),
        ),
    ] = 0,
    overflow: Annotated[
        Overflow,
        typer.Option(
            help=(
                "Past the window (prompt + tokens > block_size): 'recompute' re-prefills at every step, exactly as "
                "crop-and-recompute; 'shift' re-prefills half the window, then decodes from the cache."
            )
        ),
    ] = Overflow.recompute,
    sweep: Annotated[
        bool, typer.Option("--sweep", help="Also chart decode speed against context position, through one overflow.")
    ] = False,
    json_output: JsonOption = False,
    prompt: Annotated[
        Optional[str],
        typer.Option(
            "--prompt",
            "-p",
            help="A prompt to time instead of random tokens ('-': standard input): speculative decoding keeps "
            "proposals on real text, rarely on noise. Its tokens are the prefill test's (--prompt-tokens: its last).",
        ),
    ] = None,
    prompt_file: PromptFileOption = None,
    lookup: LookupOption = None,
    draft_model: DraftModelOption = None,
    draft_max: DraftMaxOption = 4,
    draft_min: DraftMinOption = 0,
    *,
    model_options: "ModelOptions",
) -> None:
    """Measure prefill and decode speed, and the KV cache's speed-up over crop-and-recompute.

    Prints a table in the manner of llama-bench (tokens/s as mean ± std over --repeat runs).

    Examples:

      manas bench

      manas bench --tokens 512 --overflow shift --no-baseline --sweep

      manas bench --depth 2048 --prompt-tokens 512 --tokens 128

      manas bench -p "$(cat notes.txt) Repeat the notes:" --lookup 2 --no-baseline

      manas bench --json | jq '.tests[] | {name, tokens_per_s_mean}'
    """

    run(
        tokens=tokens,
        prompt_tokens=prompt_tokens,
        repeat=repeat,
        batch=batch,
        baseline=baseline,
        overflow=overflow.value,
        sweep=sweep,
        json_output=json_output,
        model_options=model_options,
        depth=depth,
        prompt=prompt,
        prompt_file=prompt_file,
        lookup=lookup,
        draft_model=draft_model,
        draft_max=draft_max,
        draft_min=draft_min,
    )
