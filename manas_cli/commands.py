"""What each command does: engine calls in, rendering out. Imported only when a command runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import CheckpointError, InputError, interrupt_exit_code
from .files import check_output_file


def read_text_file(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path} is not valid UTF-8 (byte {exc.start}): convert it to UTF-8") from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not text.strip():
        raise InputError(f"{what} {path} is empty")
    return text


def train(**options) -> None:
    # Before any work, even importing torch: a run may replace --out only when told to (--resume continues it,
    # --force replaces it), and never with its own input.
    out: Path = options["out"]
    replace = options["resume"] or options["force"]
    check_output_file(out, replace, inputs=(options["text_file"], options["tokenizer_file"]))

    import torch

    from .render import stderr_console, train_progress
    from .runtime import resolve_device, set_threads
    from .tokenizer import build_encoding, encode_long_text
    from .training import TrainSettings, make_dataset, train

    console = stderr_console()
    set_threads(options["threads"])
    text = read_text_file(options["text_file"], "training text")
    if options["resume"]:
        model, spec, start_step, best = resumed_model(out, resolve_device(options["device"].value))
    else:
        spec = training_tokenizer(text, options, console)
        if spec is None:  # --tokenizer-only: the ranks are written, there is no model to train
            return
        model, start_step, best = new_model(spec, options).to(resolve_device(options["device"].value)), 0, math.inf
    encoding = build_encoding(spec)
    data = make_dataset(text, lambda part: encode_long_text(encoding, part), options["val_fraction"], model.config.block_size)
    settings = TrainSettings(
        steps=options["steps"], batch_size=options["batch_size"], lr=options["lr"],
        warmup_steps=options["warmup_steps"], eval_every=options["eval_every"], seed=options["seed"],
    )
    console.print(
        f"training {model.num_parameters():,} parameters on {len(data.train_ids):,} tokens "
        f"({len(data.val_ids):,} held out) on {next(model.parameters()).device}, {torch.get_num_threads()} threads"
    )
    with train_progress(console, settings.steps, start_step) as show:
        for event in train(model, data, settings, out, spec, start_step, best, overwrite=replace):
            show(event)
    console.print(f"best checkpoint: {out}")


def training_tokenizer(text: str, options: dict, console) -> dict | None:
    """GPT-2's ranks from --tokenizer-file, or a BPE trained on the text (written alone with --tokenizer-only)."""
    from .bpe import train_bpe
    from .files import atomic_write
    from .tokenizer import bpe_spec, encode_ranks, spec_from_tiktoken_file

    if options["tokenizer"].value == "gpt2":
        if options["tokenizer_file"] is None:
            raise InputError("--tokenizer gpt2 needs --tokenizer-file PATH (a .tiktoken ranks file such as gpt2.tiktoken)")
        return spec_from_tiktoken_file(options["tokenizer_file"])
    with console.status(f"training a {options['vocab_size']}-token byte-level BPE"):
        ranks = train_bpe(text, options["vocab_size"])
    if options["tokenizer_only"]:
        out = options["out"]
        atomic_write(
            out, lambda tmp: Path(tmp).write_text(encode_ranks(ranks), encoding="ascii"), overwrite=options["force"]
        )
        console.print(f"wrote {len(ranks)} BPE ranks to {out}")
        return None
    return bpe_spec(ranks)


def new_model(spec: dict, options: dict):
    import torch

    from .model import GPT, GPTConfig
    from .tokenizer import build_encoding, vocabulary_size

    try:
        config = GPTConfig(
            vocab_size=vocabulary_size(build_encoding(spec)), block_size=options["block_size"],
            n_layer=options["n_layer"], n_head=options["n_head"], n_kv_head=options["n_kv_head"],
            n_embd=options["n_embd"], position_encoding=options["position_encoding"].value, dropout=options["dropout"],
        )
    except ValueError as exc:
        raise InputError(f"invalid model shape: {exc}") from None
    torch.manual_seed(options["seed"])
    return GPT(config)


def resumed_model(out: Path, device):
    """The checkpoint at --out with its tokenizer, and the step and validation loss it was saved at."""
    from .checkpoint import load_checkpoint
    from .quantize import is_quantized

    checkpoint = load_checkpoint(out, device=device)
    if is_quantized(checkpoint.model):
        raise InputError(f"{out} is an int8 checkpoint: training needs float weights (resume from the float one)")
    step, val_loss = training_progress(checkpoint.metadata.get("training", "{}"), out)
    return checkpoint.model, checkpoint.tokenizer_spec, step, val_loss


def training_progress(text: str, path: Path) -> tuple[int, float]:
    """The step and validation loss in a checkpoint's `training` metadata (step 0 and no loss when it has none)."""
    try:
        progress = json.loads(text)
    except (ValueError, RecursionError):
        progress = None
    if isinstance(progress, dict):
        step, val_loss = progress.get("step", 0), progress.get("val_loss", math.inf)
        if type(step) is int and step >= 0 and type(val_loss) in (int, float) and not math.isnan(val_loss):
            return step, float(val_loss)
    raise CheckpointError(
        f"{path}: its training metadata is not {{\"step\": N, \"val_loss\": X}} ({text[:60]!r}): "
        "resume only a checkpoint that manas train wrote, or train afresh without --resume"
    )


# ---- shared by generate, bench and inspect-cache -------------------------------------------------------------

CHECKPOINT_ENV = "MANAS_CHECKPOINT"
DEFAULT_CHECKPOINT = "shakespeare.safetensors"
DEFAULT_INSPECT_PROMPT = "ROMEO:\nWhat light through yonder window breaks?"


def default_checkpoint_candidates() -> list[Path]:
    """The shipped model: beside the package in a source checkout (editable install), or in the wheel's data."""
    import sys

    return [
        Path(__file__).resolve().parent.parent / "checkpoints" / DEFAULT_CHECKPOINT,
        Path(sys.prefix) / "share" / "manas" / "checkpoints" / DEFAULT_CHECKPOINT,
    ]


def resolve_checkpoint(option: Path | None) -> Path:
    import os

    if option is not None:
        return option
    if os.environ.get(CHECKPOINT_ENV):
        return Path(os.environ[CHECKPOINT_ENV])
    candidates = default_checkpoint_candidates()
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise InputError(f"no checkpoint given and none found (looked at ${CHECKPOINT_ENV}, {looked}): pass --checkpoint PATH")


def checkpoint_file(path: Path) -> Path:
    """path, unless it is a folder or a pipe: say so (opening a FIFO would block, and a checkpoint is read by seeking)."""
    if path.is_dir():
        raise InputError(f"checkpoint {path} is a folder, not a file: pass the .safetensors file inside it")
    if path.exists() and not path.is_file():
        raise InputError(f"checkpoint {path} is not a regular file (a pipe or a device?): save it to a file and pass that")
    return path


def require_stdout() -> None:
    """Commands whose product is stdout refuse a closed one (`>&-`) before any work, not after loading a model."""
    import sys

    if sys.stdout is None:
        raise InputError("standard output is closed (>&-): redirect it to a file, or to /dev/null to discard it")


def load_model(options: dict):
    """The checkpoint on the chosen device, dtype and thread count, quantized if asked, its float weights laid out
    for decoding."""
    from .checkpoint import load_checkpoint
    from .model import use_decode_layout
    from .quantize import is_quantized
    from .runtime import resolve_device, resolve_dtype, set_threads

    set_threads(options["threads"])
    device = resolve_device(options["device"].value)
    dtype = resolve_dtype(options["dtype"].value, device)
    checkpoint = load_checkpoint(checkpoint_file(resolve_checkpoint(options["checkpoint"])), device=device, dtype=dtype)
    if options["quantize"] is not None:
        quantize_checkpoint(checkpoint, "run it without --quantize")
    if not is_quantized(checkpoint.model):  # int8 layers keep their own layout; the embeddings gain nothing
        use_decode_layout(checkpoint.model)
    return checkpoint


def check_memory(model, rows: int, positions: int, lower: str) -> None:
    """Refuse a run the device cannot hold before allocating it (see memory.check_fits)."""
    from .memory import check_fits

    embedding = model.token_embedding.weight
    check_fits(model.config, embedding.device, embedding.element_size(), rows, positions, lower)


def quantize_checkpoint(checkpoint, hint: str) -> None:
    """Quantize a loaded float checkpoint's model to int8, refusing one that is int8 already."""
    from .quantize import int8_tensor_names, quantize_model

    if int8 := int8_tensor_names(checkpoint.model):
        raise InputError(f"{checkpoint.path} is already quantized: its tensor {int8[0]} is int8 ({hint})")
    quantize_model(checkpoint.model)


def read_prompt(prompt: str | None, prompt_file: Path | None, default: str | None = None) -> str:
    """--prompt TEXT, --prompt-file PATH, '-' or nothing for standard input (or `default`, where one is given)."""
    import sys

    if prompt is not None and prompt_file is not None:
        import typer

        # A usage error (exit 2), like any other misuse of the flags.
        raise typer.BadParameter("give either --prompt or --prompt-file, not both", param_hint="'--prompt-file'")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"prompt file {prompt_file} is not valid UTF-8 (byte {exc.start})") from None
        except OSError as exc:
            raise InputError(f"cannot read prompt file {prompt_file}: {exc.strerror}") from None
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and default is not None:
        return default
    if sys.stdin is not None and sys.stdin.isatty():
        print("reading the prompt from standard input (end it with Ctrl-D)", file=sys.stderr)
    data = sys.stdin.buffer.read() if sys.stdin is not None else b""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"standard input is not valid UTF-8 (byte {exc.start}): pass UTF-8 text") from None


# The most prompt characters ever encoded: a window's worth for GPT-2 (1024 tokens of up to 128 bytes, twice over),
# and well under the whitespace run (~10^6 characters) that overflows tiktoken's regex stack.
PROMPT_TAIL_CHARS = 300_000


def encode_prompt(checkpoint, text: str, console) -> list[int]:
    """Token ids of the prompt, cropped to the window with a notice; the empty prompt is end-of-text.

    Only the text that can reach the window is encoded: block_size tokens never span more than block_size times
    the longest token's bytes in characters, so twice that (the tokens at the cut may differ, and are cropped) is
    exact, up to PROMPT_TAIL_CHARS. That bound also keeps any whitespace run far below the length (~10^6
    characters) at which tiktoken's regex engine overflows its stack and panics."""
    from .tokenizer import encode_text, end_of_text_id, longest_token_bytes

    block_size = checkpoint.model.config.block_size
    tail = min(2 * block_size * longest_token_bytes(checkpoint.encoding), PROMPT_TAIL_CHARS)
    cut = len(text) > tail
    ids = encode_text(checkpoint.encoding, text[-tail:] if cut else text)
    if not ids:
        eot = end_of_text_id(checkpoint.encoding)
        if eot is None:
            raise InputError("the prompt is empty and this model's vocabulary has no <|endoftext|> to start from")
        ids = [eot]
    if cut:
        console.print(
            f"notice: the prompt has {len(text)} characters; encoding its last {tail} and keeping its last "
            f"{min(len(ids), block_size)} tokens (the model's block_size is {block_size})"
        )
    elif len(ids) > block_size:
        console.print(f"notice: the prompt has {len(ids)} tokens; keeping its last {block_size} (the model's block_size)")
    return ids[-block_size:]


# ---- generate -------------------------------------------------------------------------------------------------


# Past the window, recompute mode re-prefills at every step: with this many tokens still to come, say why it slows.
LATE_TOKENS = 32


def generate(**options) -> None:
    import sys
    from contextlib import nullcontext

    import torch
    import typer

    from .generation import GenerationStats, generate, prompt_batch
    from .kv_cache import CacheSession
    from .live import LiveDisplay, piped, shares_terminal
    from .quantize import weights_name
    from .render import Output, generation_stats_line, recompute_notice, stderr_console
    from .sampling import Sampler, seeded_generator
    from .streaming import TextStream
    from .tokenizer import decodable, end_of_text_id

    require_stdout()
    console = stderr_console(quiet=options["quiet"])
    talk = sys.stderr.isatty() and not options["quiet"]  # notices meant for a person at a terminal
    show_stats = not options["quiet"] and (options["stats"] if options["stats"] is not None else sys.stderr.isatty())
    live = show_stats and talk and not console.is_dumb_terminal and not piped(sys.stdout)
    text = read_prompt(options["prompt"], options["prompt_file"])
    checkpoint = load_model(options)
    model, encoding = checkpoint.model, checkpoint.encoding
    ids = encode_prompt(checkpoint, text, console)
    batch, max_tokens, block_size = options["num_samples"], options["max_tokens"], model.config.block_size
    positions = min(block_size, len(ids) + max_tokens)
    check_memory(model, batch, positions, "--num-samples")
    generator, seed = seeded_generator(options["seed"], model)
    sampler = Sampler(options["temperature"], options["top_k"], options["top_p"], generator, torch.tensor(decodable(encoding)))
    eot = end_of_text_id(encoding)
    record = options["json_output"] or batch > 1  # a single streamed sample keeps none of its text
    streams = [TextStream(encoding, eot, options["stop"] or (), record) for _ in range(batch)]
    shared = shares_terminal(sys.stdout, sys.stderr)
    out = Output(sys.stdout, json_lines=options["json_output"], samples=batch, hold_lines=live and shared)
    stats = GenerationStats(prompt_tokens=len(ids), batch_size=batch)
    session = CacheSession(model, options["cache"].value, capacity=positions)
    overflow = options["overflow"].value
    steps = generate(model, prompt_batch(ids, batch, model), sampler, max_tokens, eot, overflow, session)
    display = LiveDisplay(console, out, streams, stats, max_tokens, block_size, session.storage)
    warn_late = talk and overflow == "recompute"

    def on_step(step) -> None:
        window_filled = step.kind == "re_prefill" and stats.re_prefills == 1
        if warn_late and window_filled and max_tokens - stats.steps >= LATE_TOKENS:
            # On the text's own terminal a notice would cut through a line: the live region shows it, or it waits.
            (display.notice if live or shared else console.print)(recompute_notice(block_size))
        if live:
            display.update()

    if options["echo"]:
        out.text(0, text)
    with display if live else nullcontext():
        interruption = stream_text(steps, streams, stats, out, on_step)
    storage = session.storage()
    if options["json_output"]:
        for stream in streams:
            out.json_line(sample_record(stream, stats, storage, seed, weights_name(model)))
    else:
        out.close_text([stream.text for stream in streams], echo=text if options["echo"] else None)
    display.keep_notices()
    if show_stats:
        console.print(generation_stats_line(stats, storage))
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
                out.text(row, stream.feed(token))
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


def sample_record(stream, stats, storage: dict, seed: int, weights: str) -> dict:
    """One --json line: the contract fields first, extras after."""
    return {
        "text": stream.text,
        "tokens": stream.tokens,
        "finish_reason": stream.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": len(stream.tokens),
        "ttft_s": stats.ttft_s,
        "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "re_prefills": stats.re_prefills,
        "cache": storage,
        "seed": seed,
        "weights": weights,
    }


# ---- bench ----------------------------------------------------------------------------------------------------


def bench(**options) -> None:
    import torch

    from .bench import run_bench, sweep
    from .quantize import weights_bytes, weights_name
    from .render import bench_progress, bench_table, json_line, stderr_console, sweep_chart, token_progress

    require_stdout()
    console = stderr_console()
    checkpoint = load_model(options)
    model = checkpoint.model
    block_size = model.config.block_size
    check_memory(model, options["batch"], min(block_size, options["prompt_tokens"] + options["tokens"]),
                 "--batch (or --prompt-tokens, --tokens)")
    device = next(model.parameters()).device
    info = {
        "path": str(checkpoint.path),
        "parameters": model.num_parameters(),
        "size_bytes": weights_bytes(model),
        "block_size": model.config.block_size,
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "weights": weights_name(model),
        "weights_bytes": weights_bytes(model),
    }
    runs = options["repeat"] * (2 if options["baseline"] else 1)
    with bench_progress(console, runs) as advance:
        result = run_bench(
            model, options["prompt_tokens"], options["tokens"], options["repeat"], options["batch"],
            options["baseline"], options["cache"].value, options["overflow"].value, on_run=advance,
        )
    sweep_rows = None
    if options["sweep"]:
        sweep_tokens = block_size + block_size // 2
        with token_progress(console, sweep_tokens, "sweeping decode speed across the window") as advance:
            sweep_rows = sweep(model, min(options["prompt_tokens"], block_size // 8), sweep_tokens, 12, on_token=advance)
    report = {
        "model": info,
        "tests": [
            {"name": m.name, "tokens_per_s_mean": m.mean, "tokens_per_s_std": m.std, "runs": m.tokens_per_s}
            for m in result.measurements
        ],
        "ttft_s": result.ttft_s,
        "speedup": result.speedup,
        "re_prefills": result.re_prefills,
        "peak_memory_bytes": result.peak_memory_bytes,
        "cache_bytes": result.cache_bytes,
        "batch": options["batch"],
        "repeat": options["repeat"],
        "overflow": options["overflow"].value,
    }
    if sweep_rows is not None:
        report["sweep"] = sweep_rows
    if options["json_output"]:
        print(json_line(report))
        return
    from rich.console import Console

    stdout = Console(highlight=False, no_color=console.no_color, soft_wrap=True)  # a pipe gets whole lines
    stdout.print(bench_table(report))
    if sweep_rows is not None:
        stdout.print(sweep_chart(sweep_rows))


# ---- inspect-cache --------------------------------------------------------------------------------------------


def inspect_cache(**options) -> None:
    from .generation import generate, prompt_batch, GenerationStats
    from .kv_cache import CacheSession, cache_report
    from .quantize import weights_bytes, weights_name
    from .render import cache_view, json_line, stderr_console, token_progress
    from .sampling import Sampler

    require_stdout()
    console = stderr_console()
    text = read_prompt(options["prompt"], options["prompt_file"], default=DEFAULT_INSPECT_PROMPT)
    checkpoint = load_model(options)
    model = checkpoint.model
    ids = encode_prompt(checkpoint, text, console)
    positions = min(model.config.block_size, len(ids) + options["tokens"])
    check_memory(model, 1, positions, "--tokens")
    session = CacheSession(model, options["cache"].value, capacity=positions)
    stats = GenerationStats(prompt_tokens=len(ids), re_prefill_positions=[])
    if options["tokens"] == 0:
        session.prefill(prompt_batch(ids, 1, model))
    else:
        # The prompt's prefill yields the first new token; the remaining tokens decode from the cache.
        steps = generate(model, prompt_batch(ids, 1, model), Sampler(temperature=0.0), options["tokens"] + 1,
                         session=session)
        with token_progress(console, options["tokens"] + 1, "decoding") as advance:
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
        "device": str(next(model.parameters()).device),
        "weights": weights_name(model),
        "weights_bytes": weights_bytes(model),
        "prompt_tokens": len(ids),
        "decoded_tokens": options["tokens"],
    }
    if options["json_output"]:
        print(json_line({**report, **header}))
        return
    from rich.console import Console

    Console(highlight=False, no_color=console.no_color, soft_wrap=True).print(cache_view(report, header))


# ---- convert / export -------------------------------------------------------------------------------------------


def convert(**options) -> None:
    from .convert import convert_checkpoint
    from .render import stderr_console

    result = convert_checkpoint(
        options["src"], options["out"], config_path=options["config"], tokenizer=options["tokenizer"],
        tokenizer_file=options["tokenizer_file"], tokenizer_meta=options["tokenizer_meta"], force=options["force"],
    )
    config = result.config
    stderr_console().print(
        f"converted the {result.source_kind} {options['src']}: {result.parameters:,} parameters "
        f"(n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, block_size={config.block_size}, "
        f"vocab_size={config.vocab_size}, bias={config.bias}), tokenizer: {result.tokenizer}\nwrote {options['out']}"
    )


def quantize(**options) -> None:
    from .checkpoint import load_checkpoint, save_checkpoint
    from .files import check_output_file
    from .render import stderr_console

    src, out = options["checkpoint"], options["out"]
    check_output_file(out, options["force"], inputs=(src,))
    checkpoint = load_checkpoint(src)
    quantize_checkpoint(checkpoint, "there is nothing to quantize")
    save_checkpoint(out, checkpoint.model, checkpoint.tokenizer_spec, overwrite=options["force"])
    stderr_console().print(
        f"quantized {src} to int8: {src.stat().st_size:,} → {out.stat().st_size:,} bytes\nwrote {out}"
    )


def export(**options) -> None:
    from .render import stderr_console

    if options["output_format"].value == "gguf":
        from .export_gguf import export_gguf

        outtype = options["outtype"].value if options["outtype"] else "f16"
        done = export_gguf(options["checkpoint"], options["out"], outtype=outtype, force=options["force"])
        stderr_console().print(
            f"wrote a GGUF model (llama.cpp architecture {done.architecture}, {done.outtype}) to {done.out}: "
            f"{done.tensors} tensors, {done.size_bytes:,} bytes"
        )
        return
    if options["outtype"] is not None:
        import typer

        raise typer.BadParameter("--outtype applies to --format gguf only", param_hint="'--outtype'")
    from .export import export_hf

    result = export_hf(options["checkpoint"], options["out"], force=options["force"])
    stderr_console().print(f"wrote a Hugging Face {result.architecture} model to {result.out}: {', '.join(result.files)}")
