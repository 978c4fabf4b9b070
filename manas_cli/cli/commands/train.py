"""`manas train`: a GPT and its byte-level BPE trained on a text file, the best-validation checkpoint saved."""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from ...errors import CheckpointError, InputError
from ..flags import Device, DeviceOption, PositionEncoding, ThreadsOption, TrainTokenizer, checked_setting


@dataclass(frozen=True)
class ModelShape:
    """The shape of a model trained afresh."""

    n_layer: int
    n_head: int
    n_kv_head: int | None
    n_embd: int
    block_size: int
    position_encoding: str
    dropout: float


def run(
    *,
    text_file: Path,
    out: Path,
    shape: ModelShape,
    vocab_size: int,
    tokenizer: str,
    tokenizer_file: Path | None,
    tokenizer_only: bool,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    eval_every: int,
    seed: int,
    val_fraction: float,
    resume: bool,
    force: bool,
    device: str,
    threads: int | None,
) -> None:
    # Before any work, even importing torch: a run may replace --out only when told to (--resume continues it,
    # --force replaces it), and never with its own input.
    from ...files import check_output_file
    from .common import read_text_file

    replace = resume or force
    check_output_file(out, replace, inputs=(text_file, tokenizer_file))

    import torch

    from ...engine.threads import choose_threads
    from ...formats.tokenizer import build_encoding, encode_long_text
    from ...torch_engine.runtime import resolve_device
    from ...training import TrainSettings, make_dataset, train
    from ..render import plural, stderr_console, train_progress

    console = stderr_console()
    torch.set_num_threads(choose_threads(threads).threads)
    text = read_text_file(text_file, "training text", "train on a part of it (head -c 64M FILE > part.txt)")
    if resume:
        model, spec, start_step, best = resumed_model(out, resolve_device(device))
    else:
        spec = training_tokenizer(text, tokenizer, tokenizer_file, vocab_size, console)
        if tokenizer_only:
            write_ranks(spec, out, force, console)
            return
        model, start_step, best = new_model(spec, shape, seed).to(resolve_device(device)), 0, math.inf
    encoding = build_encoding(spec)
    data = make_dataset(text, lambda part: encode_long_text(encoding, part), val_fraction, model.config.block_size)
    settings = TrainSettings(
        steps=steps, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps, eval_every=eval_every, seed=seed
    )
    device, threads = next(model.parameters()).device, plural(torch.get_num_threads(), "thread")
    console.print(
        f"training {model.num_parameters():,} parameters on {len(data.train_ids):,} tokens "
        f"({len(data.val_ids):,} held out) on {device}, {threads}"
    )
    with train_progress(console, settings.steps, start_step) as show:
        for event in train(model, data, settings, out, spec, start_step, best, overwrite=replace):
            show(event)
    console.print(f"best checkpoint: {out}")


def training_tokenizer(text: str, tokenizer: str, tokenizer_file: Path | None, vocab_size: int, console) -> dict:
    """GPT-2's ranks from --tokenizer-file, or a BPE trained on the text."""
    from ...formats.bpe import train_bpe
    from ...formats.tokenizer import bpe_spec, spec_from_tiktoken_file

    if tokenizer == "gpt2":
        if tokenizer_file is None:
            raise InputError(
                "--tokenizer gpt2 needs --tokenizer-file PATH (a .tiktoken ranks file such as gpt2.tiktoken)"
            )
        return spec_from_tiktoken_file(tokenizer_file)
    with console.status(f"training a {vocab_size}-token byte-level BPE"):
        return bpe_spec(train_bpe(text, vocab_size))


def write_ranks(spec: dict, out: Path, force: bool, console) -> None:
    """--tokenizer-only: the BPE's ranks as a .tiktoken file, and no model."""
    from ...files import atomic_write
    from ...formats.tokenizer import decode_ranks, encode_ranks

    ranks = decode_ranks(spec["ranks"])
    atomic_write(out, lambda tmp: Path(tmp).write_text(encode_ranks(ranks), encoding="ascii"), overwrite=force)
    console.print(f"wrote {len(ranks)} BPE ranks to {out}")


def new_model(spec: dict, shape: ModelShape, seed: int):
    import torch

    from ...formats.tokenizer import build_encoding, vocabulary_size
    from ...torch_engine.model import GPT, GPTConfig

    try:
        config = GPTConfig(
            vocab_size=vocabulary_size(build_encoding(spec)),
            block_size=shape.block_size,
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            n_kv_head=shape.n_kv_head,
            n_embd=shape.n_embd,
            position_encoding=shape.position_encoding,
            dropout=shape.dropout,
        )
    except ValueError as exc:
        raise InputError(f"invalid model shape: {exc}") from None
    torch.manual_seed(seed)
    return GPT(config)


def resumed_model(out: Path, device):
    """The checkpoint at --out with its tokenizer, and the step and validation loss it was saved at."""
    from ...formats.checkpoint import load_checkpoint
    from ...torch_engine.quantize import is_quantized, quantization

    checkpoint = load_checkpoint(out, device=device)
    if is_quantized(checkpoint.model):
        raise InputError(
            f"{out} is an {quantization(checkpoint.model)} checkpoint: training needs float weights "
            "(resume from the float one)"
        )
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
        f'{path}: its training metadata is not {{"step": N, "val_loss": X}} ({text[:60]!r}): '
        "resume only a checkpoint that manas train wrote, or train afresh without --resume"
    )


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(
    text_file: Annotated[Path, typer.Argument(help="UTF-8 training text; its last --val-fraction is held out.")],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Checkpoint to write (.safetensors), or ranks file with --tokenizer-only."),
    ],
    n_layer: Annotated[int, typer.Option(min=1, help="Transformer blocks.")] = 6,
    n_head: Annotated[int, typer.Option(min=1, help="Query heads per block.")] = 8,
    n_kv_head: Annotated[
        Optional[int], typer.Option(min=1, help="Key/value heads (fewer than --n-head: grouped-query attention).")
    ] = 2,
    n_embd: Annotated[int, typer.Option(min=1, help="Width of the residual stream.")] = 256,
    block_size: Annotated[int, typer.Option(min=2, help="Context window in tokens.")] = 256,
    position_encoding: Annotated[
        PositionEncoding, typer.Option(help="rope (rotary) or learned (GPT-2's table).")
    ] = PositionEncoding.rope,
    vocab_size: Annotated[int, typer.Option(min=257, help="Size of the byte-level BPE trained on the text.")] = 2048,
    tokenizer: Annotated[
        TrainTokenizer, typer.Option(help="'bpe': train one on the text; 'gpt2': use --tokenizer-file's ranks.")
    ] = TrainTokenizer.bpe,
    tokenizer_file: Annotated[
        Optional[Path], typer.Option(help="A .tiktoken ranks file (with --tokenizer gpt2).")
    ] = None,
    tokenizer_only: Annotated[
        bool, typer.Option(help="Train the BPE and write its .tiktoken ranks to --out; no model.")
    ] = False,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps in all (a resumed run continues to this).")] = 1500,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences of block_size tokens per step.")] = 16,
    lr: Annotated[
        float, typer.Option(min=0.0, help="Peak learning rate (AdamW, linear warm-up, cosine decay to lr/10).")
    ] = 1.5e-3,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Steps of linear learning-rate warm-up.")] = 100,
    dropout: Annotated[float, typer.Option(min=0.0, max=0.99, help="Dropout probability while training.")] = 0.2,
    eval_every: Annotated[int, typer.Option(min=1, help="Steps between validation (and best-checkpoint saves).")] = 100,
    seed: Annotated[
        int,
        typer.Option(
            callback=checked_setting("seed"), help="Seed for initialization and batch sampling (0 <= seed < 2^64)."
        ),
    ] = 1337,
    val_fraction: Annotated[
        float, typer.Option(min=0.001, max=0.5, help="Held-out tail of the text for validation.")
    ] = 0.1,
    resume: Annotated[
        bool,
        typer.Option(help="Continue from the checkpoint at --out (its weights and step; fresh optimizer moments)."),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite --out if it exists (without --resume: start afresh).")
    ] = False,
    device: DeviceOption = Device.auto,
    threads: ThreadsOption = None,
) -> None:
    """Train a GPT (and its byte-level BPE) on a text file, saving the best-validation checkpoint.

    Examples:

      manas train input.txt --out model.safetensors

      manas train input.txt -o tiny.safetensors --n-layer 2 --n-embd 64

      manas train input.txt -o bpe.tiktoken --tokenizer-only --vocab-size 4096
    """

    shape = ModelShape(
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_embd,
        block_size=block_size,
        position_encoding=position_encoding.value,
        dropout=dropout,
    )
    run(
        text_file=text_file,
        out=out,
        shape=shape,
        vocab_size=vocab_size,
        tokenizer=tokenizer.value,
        tokenizer_file=tokenizer_file,
        tokenizer_only=tokenizer_only,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup_steps=warmup_steps,
        eval_every=eval_every,
        seed=seed,
        val_fraction=val_fraction,
        resume=resume,
        force=force,
        device=device.value,
        threads=threads,
    )
