"""What each command does: engine calls in, rendering out. Imported only when a command runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import InputError


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
    from .bpe import train_bpe
    from .checkpoint import atomic_write, load_checkpoint, read_metadata
    from .model import GPT, GPTConfig
    from .render import stderr_console, train_progress
    from .runtime import resolve_device, set_threads
    from .tokenizer import build_encoding, bpe_spec, encode_ranks, spec_from_tiktoken_file
    from .training import TrainSettings, make_dataset, train

    import torch

    console = stderr_console()
    set_threads(options["threads"])
    text = read_text_file(options["text_file"], "training text")
    out: Path = options["out"]
    if not out.parent.is_dir():
        raise InputError(f"the folder of --out {out} does not exist")

    if options["tokenizer"] == "gpt2":
        if options["tokenizer_file"] is None:
            raise InputError("--tokenizer gpt2 needs --tokenizer-file PATH (a .tiktoken ranks file such as gpt2.tiktoken)")
        spec = spec_from_tiktoken_file(options["tokenizer_file"])
    elif options["tokenizer"] == "bpe":
        with console.status(f"training a {options['vocab_size']}-token byte-level BPE"):
            ranks = train_bpe(text, options["vocab_size"])
        spec = bpe_spec(ranks)
        if options["tokenizer_only"]:
            atomic_write(out, lambda tmp: Path(tmp).write_text(encode_ranks(ranks), encoding="ascii"))
            console.print(f"wrote {len(ranks)} BPE ranks to {out}")
            return
    else:
        raise InputError(f"--tokenizer must be 'bpe' or 'gpt2', got {options['tokenizer']!r}")

    encoding = build_encoding(spec)
    device = resolve_device(options["device"].value)
    start_step, best = 0, math.inf
    if options["resume"]:
        checkpoint = load_checkpoint(out, device=device)
        model, spec, encoding = checkpoint.model, checkpoint.tokenizer_spec, checkpoint.encoding
        progress = json.loads(read_metadata(out).get("training", "{}"))
        start_step, best = progress.get("step", 0), progress.get("val_loss", math.inf)
    else:
        try:
            config = GPTConfig(
                vocab_size=encoding.n_vocab, block_size=options["block_size"], n_layer=options["n_layer"],
                n_head=options["n_head"], n_kv_head=options["n_kv_head"], n_embd=options["n_embd"],
                position_encoding=options["position_encoding"].value, dropout=options["dropout"],
            )
        except ValueError as exc:
            raise InputError(f"invalid model shape: {exc}") from None
        torch.manual_seed(options["seed"])
        model = GPT(config).to(device)
    data = make_dataset(text, encoding.encode_ordinary, options["val_fraction"], model.config.block_size)
    settings = TrainSettings(
        steps=options["steps"], batch_size=options["batch_size"], lr=options["lr"],
        warmup_steps=options["warmup_steps"], eval_every=options["eval_every"], seed=options["seed"],
    )
    console.print(
        f"training {model.num_parameters():,} parameters on {len(data.train_ids):,} tokens "
        f"({len(data.val_ids):,} held out) on {device}, {torch.get_num_threads()} threads"
    )
    with train_progress(console, settings.steps, start_step) as show:
        for event in train(model, data, settings, out, spec, start_step, best):
            show(event)
    console.print(f"best checkpoint: {out}")
