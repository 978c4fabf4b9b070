"""What generate, bench, inspect-cache and train share: finding and loading the model, reading the prompt."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...errors import InputError, ManasError


# The most text manas reads as one input (a prompt, a text to score or train on): endless input (`yes |`, a FIFO,
# /dev/zero) must not take the machine's memory. A generation encodes at most PROMPT_TAIL_CHARS of its prompt.
MAX_TEXT_BYTES = 64 * 2**20


def read_bounded(source: BinaryIO, what: str, advice: str) -> str:
    """At most MAX_TEXT_BYTES of UTF-8 text from source; `what` names it and `advice` says what to do when it is
    longer."""
    data = source.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise InputError(f"{what} is over {MAX_TEXT_BYTES // 2**20} MiB, the most manas reads as one text: {advice}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not valid UTF-8 (byte {exc.start}): convert it to UTF-8") from None


def read_text_file(path: Path, what: str, advice: str) -> str:
    try:
        with path.open("rb") as f:
            text = read_bounded(f, f"{what} {path}", advice)
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not text.strip():
        raise InputError(f"{what} {path} is empty")
    return text


def read_stdin(advice: str) -> str:
    """Standard input as text (nothing when it is closed), bounded like a file."""
    import sys

    return read_bounded(sys.stdin.buffer, "standard input", advice) if sys.stdin is not None else ""


CHECKPOINT_ENV = "MANAS_CHECKPOINT"
DEFAULT_CHECKPOINT = "shakespeare.safetensors"


def default_checkpoint_candidates() -> list[Path]:
    """The shipped model: beside the package in a source checkout (editable install), or in the wheel's data."""
    import sys

    return [
        Path(__file__).resolve().parents[3] / "checkpoints" / DEFAULT_CHECKPOINT,
        Path(sys.prefix) / "share" / "manas" / "checkpoints" / DEFAULT_CHECKPOINT,
    ]


def resolve_checkpoint(option: Path | None) -> Path:
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


@dataclass(frozen=True)
class ModelOptions:
    """The flags generate, bench and inspect-cache share: which model, where, and how."""

    checkpoint: Path | None = None  # None: $MANAS_CHECKPOINT, else the shipped model
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    quantize: str | None = None  # "int8" or "int4"
    cache: str = "dynamic"  # the KV cache's allocation
    engine: str = "auto"  # "auto", "native" or "torch"
    debug: bool = False  # --debug: show the compiler's message when the native core does not build


def load_model(options: ModelOptions, console=None):
    """The checkpoint on the chosen device, dtype and thread count (and how that count was chosen), quantized if
    asked, and the engine that runs it (engine/native.py's EngineChoice): the native core, or torch with its
    float weights laid out for decoding. What there is to say about the engine goes to `console`, if given.

    On the CPU in float32 the core runs the mapped file itself and torch is never imported; torch loads only
    where it is needed: asked for, a GPU, a half-precision dtype, --quantize, or a core that does not build."""
    from ...engine.threads import choose_threads
    from ...native.build import NativeUnavailable

    threads = choose_threads(options.threads)
    path = _naming_the_environment(options, lambda: checkpoint_file(resolve_checkpoint(options.checkpoint)))
    unavailable = None
    if not torch_needed(options):
        from ...engine.engines import open_native
        from ...formats.header import Checkpoint, open_checkpoint

        mapped = _naming_the_environment(options, lambda: open_checkpoint(path))
        try:
            engine = _naming_the_environment(options, lambda: open_native(mapped, threads.threads, compiling(console)))
        except NativeUnavailable as exc:
            unavailable = exc  # torch runs it, without trying to build the core again
        else:
            header = mapped.header
            checkpoint = Checkpoint(engine.model, header.encoding, header.tokenizer_spec, path, header.metadata)
            if console is not None:
                report_engine(console, engine, options.debug)
            return checkpoint, threads, engine
    return _load_with_torch(options, path, threads, unavailable, console)


def _load_with_torch(options: ModelOptions, path: Path, threads, unavailable, console):
    import torch

    from ...engine.model import use_decode_layout
    from ...engine.engines import choose_engine
    from ...engine.quantize import is_quantized
    from ...engine.runtime import resolve_device, resolve_dtype
    from ...formats.checkpoint import load_checkpoint

    torch.set_num_threads(threads.threads)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    checkpoint = _naming_the_environment(options, lambda: load_checkpoint(path, device=device, dtype=dtype))
    if options.quantize is not None:
        quantize_checkpoint(checkpoint, options.quantize, "run it without --quantize")
    engine = choose_engine(options.engine, checkpoint.model, threads.threads, unavailable, compiling(console))
    if engine.name == "native":
        torch.set_num_threads(1)  # the core computes and samples: torch's OpenMP workers would only spin beside it
    elif not is_quantized(checkpoint.model):  # quantized layers keep their own layout; the embeddings gain nothing
        use_decode_layout(checkpoint.model)
    if console is not None:
        report_engine(console, engine, options.debug)
    return checkpoint, threads, engine


def torch_needed(options: ModelOptions) -> bool:
    """Whether the run needs torch before its model loads: the torch engine asked for, a GPU (or a machine that
    may have one: CUDA's or ROCm's device files), a half-precision dtype, or --quantize."""
    gpu = options.device not in ("auto", "cpu") or (options.device == "auto" and any(
        os.path.exists(device) for device in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")))
    return options.engine == "torch" or gpu or options.dtype not in ("auto", "float32") or options.quantize is not None


def _naming_the_environment(options: ModelOptions, load):
    """load(), whose error says where the path came from when it is $MANAS_CHECKPOINT's."""
    try:
        return load()
    except ManasError as exc:
        if options.checkpoint is None and os.environ.get(CHECKPOINT_ENV):  # the user may not remember setting it
            raise type(exc)(f"{exc} (the path comes from ${CHECKPOINT_ENV}: fix it, unset it, or pass --checkpoint)") from None
        raise


def compiling(console):
    """What to call as a compile of the core starts: a line on a terminal, so a first run's pause is explained."""
    from ..render import say

    if console is None or not console.is_terminal:
        return None
    return lambda: say(console, "compiling the native core (once per version of manas, compiler and CPU)...")


def report_engine(console, engine, debug: bool) -> None:
    """One line when this run compiled the core (once per source, compiler and CPU), one when native was asked
    for and torch runs instead; with --debug, the compiler's own message."""
    from ..render import say

    if engine.compile_s is not None:
        say(console, f"compiled the native core in {engine.compile_s:.1f} s (once: cached as {engine.library})")
    if engine.notice:
        say(console, engine.notice)
    if debug and engine.detail:
        console.print(engine.detail.rstrip(), markup=False, highlight=False)


def check_memory(engine, rows: int, positions: int, lower: str) -> None:
    """Refuse a run the device cannot hold before allocating it (see memory.check_fits)."""
    from ...engine.memory import check_fits

    model = engine.model
    itemsize = 4 if engine.name == "native" else model.token_embedding.weight.element_size()  # the core: float32
    check_fits(model.config, engine.device, itemsize, rows, positions, lower)


def quantize_checkpoint(checkpoint, kind: str, hint: str) -> None:
    """Quantize a loaded float checkpoint's model to int8 or int4, refusing one that is quantized already, or whose
    width int4's groups do not divide."""
    from ...engine.quantize import check_quantizable, quantization, quantize_model, quantized_tensor_names

    if stored := quantized_tensor_names(checkpoint.model):
        raise InputError(f"{checkpoint.path} is already quantized: its tensor {stored[0]} is "
                         f"{quantization(checkpoint.model)} ({hint})")
    try:
        check_quantizable(checkpoint.model.config, kind)
    except ValueError as exc:
        raise InputError(f"{checkpoint.path}: {exc}") from None
    quantize_model(checkpoint.model, kind)


def read_prompt(prompt: str | None, prompt_file: Path | None, default: str | None = None) -> str:
    """--prompt TEXT, --prompt-file PATH, '-' or nothing for standard input (or `default`, where one is given)."""
    import sys

    if prompt is not None and prompt_file is not None:
        import typer

        # A usage error (exit 2), like any other misuse of the flags.
        raise typer.BadParameter("give either --prompt or --prompt-file, not both", param_hint="'--prompt-file'")
    advice = "only the prompt's end reaches the model: pass that (tail -c 1000000 FILE | manas generate)"
    if prompt_file is not None:
        try:
            with prompt_file.open("rb") as f:
                return read_bounded(f, f"prompt file {prompt_file}", advice)
        except OSError as exc:
            raise InputError(f"cannot read prompt file {prompt_file}: {exc.strerror}") from None
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and default is not None:
        return default
    if sys.stdin is not None and sys.stdin.isatty():
        print("reading the prompt from standard input (end it with Ctrl-D)", file=sys.stderr)
    return read_stdin(advice)


# The most prompt characters ever encoded: a window's worth for GPT-2 (1024 tokens of up to 128 bytes, twice over),
# and well under the whitespace run (~10^6 characters) that overflows tiktoken's regex stack.
PROMPT_TAIL_CHARS = 300_000


def encode_prompt(checkpoint, text: str, console) -> list[int]:
    """Token ids of the prompt, cropped to the window with a notice; the empty prompt is end-of-text.

    Only the text that can reach the window is encoded: block_size tokens never span more than block_size times
    the longest token's bytes in characters, so twice that (the tokens at the cut may differ, and are cropped) is
    exact, up to PROMPT_TAIL_CHARS. That bound also keeps any whitespace run far below the length (~10^6
    characters) at which tiktoken's regex engine overflows its stack and panics."""
    from ...formats.tokenizer import encode_text, end_of_text_id, longest_token_bytes

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
