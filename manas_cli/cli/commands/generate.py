"""`manas generate`: stream a continuation of the prompt to stdout, stats and notices to stderr."""

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...errors import interrupt_exit_code
from ...settings import GenerationSettings, token_budget
from ..flags import (
    BatchSizeOption,
    DraftMaxOption,
    DraftMinOption,
    DraftModelOption,
    JsonOption,
    LookupOption,
    Overflow,
    OverflowOption,
    PromptFileOption,
    PromptOption,
    takes_model_flags,
    takes_setting_flags,
)

if TYPE_CHECKING:
    from ...models import ModelOptions


# Past the window, recompute mode re-prefills at every step: with this many tokens still to come, say why it slows.
LATE_TOKENS = 32


def run(
    *,
    prompt: str | None,
    prompt_file: Path | None,
    settings: GenerationSettings,
    num_samples: int,
    echo: bool,
    overflow: str,
    stats: bool | None,
    quiet: bool,
    json_output: bool,
    model_options: "ModelOptions",
    lookup: int | None = None,
    draft_model: Path | None = None,
    draft_max: int = 0,
    draft_min: int = 0,
) -> None:
    from ...engine.generation import GenerationStats, prompt_batch
    from ...engine.threads import ThreadGovernor
    from ...records import sample_record
    from ...requests import Requests, encode_prompt
    from ..live import LiveDisplay, piped, shares_terminal
    from ..render import Output, generation_stats_line, recompute_notice, say, stderr_console
    from .common import check_memory, load_model, read_prompt, require_stdout, speculation

    require_stdout()
    console = stderr_console(quiet=quiet)
    talk = sys.stderr.isatty() and not quiet  # notices meant for a person at a terminal
    show_stats = not quiet and (stats if stats is not None else sys.stderr.isatty())
    live = show_stats and talk and not console.is_dumb_terminal and not piped(sys.stdout)
    text = read_prompt(prompt, prompt_file)
    checkpoint, threads, engine = load_model(model_options, console)
    model, encoding = checkpoint.model, checkpoint.encoding
    ids = encode_prompt(checkpoint, text, console.print, settings.parse_special)
    batch, block_size = num_samples, model.config.block_size
    max_tokens = token_budget(settings.max_tokens, len(ids), block_size)
    positions = min(block_size, len(ids) + max_tokens)
    check_memory(engine, batch, positions, "--num-samples")
    draft, speculative = speculation(lookup, draft_model, draft_max, model_options, checkpoint, engine, batch)
    requests = Requests(engine, encoding, draft, speculative)
    request = requests.prepare(settings, batch, record=json_output or batch > 1)  # one streamed sample keeps no text
    seed, streams = request.seed, request.streams
    shared = shares_terminal(sys.stdout, sys.stderr)
    out = Output(sys.stdout, json_lines=json_output, samples=batch, hold_lines=live and shared)
    run_stats = GenerationStats(prompt_tokens=len(ids), batch_size=batch)
    session = engine.new_session(model_options.cache, capacity=positions)
    steps = request.steps(
        engine, prompt_batch(ids, batch), max_tokens, requests.eot, session, overflow, draft_min=draft_min
    )
    display = LiveDisplay(console, out, streams, run_stats, max_tokens, block_size, session.storage)
    warn_late = not quiet and overflow == "recompute"  # a script slowed 14× past the window is told why, too
    governor = ThreadGovernor(threads, engine.set_threads)

    storage = session.storage()  # what the cache holds after each step: a Ctrl-C during a re-prefill empties it

    def on_step(step) -> None:
        nonlocal storage
        storage = session.storage()
        governor.check()
        window_filled = step.kind == "re_prefill" and run_stats.re_prefills == 1
        if warn_late and window_filled and max_tokens - run_stats.steps >= LATE_TOKENS:
            notice = recompute_notice(block_size)
            # On the text's own terminal a notice would cut through a line: the live region shows it, or it waits.
            if live or shared:
                display.notice(notice)
            else:
                say(console, notice)
        if live:
            display.update()

    if echo:
        out.text(0, text)
    with display if live else nullcontext():
        interruption = stream_text(steps, streams, run_stats, out, on_step)
    if interruption is None:
        storage = session.storage()
    if json_output:
        for stream in streams:
            counts = {"proposed_tokens": run_stats.proposed_tokens, "accepted_tokens": run_stats.accepted_tokens}
            record = sample_record(stream, run_stats, storage, seed, engine, settings)
            out.json_line(record | (counts if request.proposer is not None else {}))
    else:
        out.close_text([stream.text for stream in streams], echo=text if echo else None)
    display.keep_notices()
    if show_stats:
        say(console, generation_stats_line(run_stats, storage, seed if settings.temperature > 0 else None))
    if interruption is not None:
        raise typer.Exit(interrupt_exit_code(interruption))


def stream_text(steps, streams, stats, out, on_step) -> KeyboardInterrupt | None:
    """Print each row's text as its tokens arrive, until every row has finished; the Ctrl-C (or SIGTERM) that
    stopped it, if one did."""
    interruption = None
    try:
        for step in steps:
            stats.update(step)
            for row, (stream, token) in enumerate(zip(streams, step.tokens)):
                out.text(row, stream.feed(token, step.logprobs[row] if step.logprobs else None))
            on_step(step)
            if all(stream.finished for stream in streams):
                break
    except KeyboardInterrupt as exc:
        interruption = exc  # keep the text so far, and still report
    finally:
        steps.close()
    for row, stream in enumerate(streams):
        out.text(row, stream.finish("interrupted" if interruption is not None else "length"))
    return interruption


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags()
@takes_setting_flags()
def command(
    prompt_argument: Annotated[
        Optional[str],
        typer.Argument(
            metavar="[PROMPT]", help="The prompt, as -p gives it (quote it: one argument).", show_default=False
        ),
    ] = None,
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    jsonl: Annotated[
        bool,
        typer.Option(
            "--jsonl",
            help=(
                "Read one JSON object per line from stdin (or --prompt-file): 'prompt', optionally 'id' and any "
                "setting by its name (max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, "
                "repeat_last_n, frequency_penalty, presence_penalty, seed, stop, logprobs), a structured output "
                "of its own (json_schema, grammar with grammar_syntax, or regex) and speculative decoding of its own "
                '("speculative": {"lookup": N, "draft": true, "draft_max": K}); write one --json record per line, '
                "in input order."
            ),
        ),
    ] = False,
    batch_size: BatchSizeOption = None,
    num_samples: Annotated[
        int, typer.Option(min=1, help="Samples of the same prompt, decoded together as one batch.")
    ] = 1,
    echo: Annotated[bool, typer.Option(help="Print the prompt before the continuation.")] = False,
    overflow: OverflowOption = Overflow.recompute,
    stats: Annotated[
        Optional[bool],
        typer.Option(
            "--stats/--no-stats",
            help="Speed and cache stats on stderr (default: when stderr is a terminal).",
            show_default=False,
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but the text.")] = False,
    json_output: JsonOption = False,
    lookup: LookupOption = None,
    draft_model: DraftModelOption = None,
    draft_max: DraftMaxOption = 4,
    draft_min: DraftMinOption = 0,
    *,
    settings: GenerationSettings,
    model_options: "ModelOptions",
) -> None:
    """Generate text from a prompt, streaming it to stdout as it is produced.

    The prompt comes from --prompt, --prompt-file, or standard input. Stats and notices go to stderr, so stdout
    holds only the text (or JSON lines with --json).

    Examples:

      manas generate --prompt 'ROMEO:' -n 100

      echo 'JULIET:' | manas generate -t 0 --stop 'ROMEO:'

      manas generate -p 'KING:' --num-samples 3 --seed 7 --json | jq .text
    """

    if quiet and stats:
        raise typer.BadParameter(
            "--quiet prints nothing but the text, and --stats asks for stats: choose one", param_hint="'--stats'"
        )
    if prompt_argument is not None:
        if prompt is not None:
            raise typer.BadParameter("give the prompt once: as an argument or with -p, not both", param_hint="'PROMPT'")
        prompt = prompt_argument
    if jsonl:
        from . import jsonl as pipeline

        if prompt is not None or echo or num_samples != 1:
            raise typer.BadParameter(
                "--jsonl reads its prompts as JSON lines (stdin or --prompt-file): it takes no "
                "--prompt, --echo or --num-samples",
                param_hint="'--jsonl'",
            )
        pipeline.run(
            prompt_file=prompt_file,
            defaults=settings,
            batch_size=batch_size,
            overflow=overflow.value,
            stats=stats,
            quiet=quiet,
            model_options=model_options,
            lookup=lookup,
            draft_model=draft_model,
            draft_max=draft_max,
        )
        return
    if settings.logprobs and not json_output:
        raise typer.BadParameter(
            "log-probabilities are written in the --json record: add --json", param_hint="'--logprobs'"
        )
    run(
        prompt=prompt,
        prompt_file=prompt_file,
        settings=settings,
        num_samples=num_samples,
        echo=echo,
        overflow=overflow.value,
        stats=stats,
        quiet=quiet,
        json_output=json_output,
        model_options=model_options,
        lookup=lookup,
        draft_model=draft_model,
        draft_max=draft_max,
        draft_min=draft_min,
    )
