"""`manas generate`: stream a continuation of the prompt to stdout, stats and notices to stderr."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

from ...errors import interrupt_exit_code
from ...models import ModelOptions
from ...settings import GenerationSettings, token_budget
from .common import check_memory, load_model, read_prompt, require_stdout

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
    model_options: ModelOptions,
) -> None:
    import typer

    from ...engine.generation import GenerationStats, generate, prompt_batch
    from ...engine.threads import ThreadGovernor
    from ...records import sample_record
    from ...requests import Requests, encode_prompt
    from ..live import LiveDisplay, piped, shares_terminal
    from ..render import Output, generation_stats_line, recompute_notice, say, stderr_console

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
    requests = Requests(engine, encoding)
    request = requests.prepare(settings, batch, record=json_output or batch > 1)  # one streamed sample keeps no text
    seed, streams = request.seed, request.streams
    shared = shares_terminal(sys.stdout, sys.stderr)
    out = Output(sys.stdout, json_lines=json_output, samples=batch, hold_lines=live and shared)
    run_stats = GenerationStats(prompt_tokens=len(ids), batch_size=batch)
    session = engine.new_session(model_options.cache, capacity=positions)
    steps = generate(
        engine,
        prompt_batch(ids, batch),
        request.sampler,
        max_tokens,
        requests.eot,
        overflow,
        session,
        settings.logprobs,
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
            out.json_line(sample_record(stream, run_stats, storage, seed, engine, settings))
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
