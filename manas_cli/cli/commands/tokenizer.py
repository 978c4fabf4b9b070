"""`manas tokenizer`: a Hugging Face folder's GPT-2 tokenizer (vocab.json and merges.txt, or tokenizer.json) as a
.tiktoken file."""

from pathlib import Path
from typing import Annotated

import typer

from ...errors import InputError


def run(*, src: Path, out: Path, force: bool) -> None:
    from ...files import atomic_write, check_output_file
    from ...formats.huggingface import HF_MERGES, HF_TOKENIZER, HF_VOCAB, folder_tokenizer
    from ...formats.tokenizer import decode_ranks
    from ..render import stderr_console

    check_output_file(out, force, inputs=(src / HF_VOCAB, src / HF_MERGES, src / HF_TOKENIZER))
    found = folder_tokenizer(src) if src.is_dir() else None
    if found is None:
        raise InputError(f"{src} is not a folder holding GPT-2's {HF_VOCAB} and {HF_MERGES}, or a {HF_TOKENIZER}")
    ranks_text, special = found[1]["ranks"], found[1]["special_tokens"]
    atomic_write(out, lambda tmp: Path(tmp).write_text(ranks_text, encoding="ascii"), overwrite=force)
    # A .tiktoken file holds ranks only: say which special tokens stay behind (--tokenizer-file adds <|endoftext|>).
    left = f"; not in it (a .tiktoken file holds ranks only): {', '.join(sorted(special))}" if special else ""
    stderr_console().print(f"wrote {len(decode_ranks(ranks_text)):,} BPE ranks from {src} to {out}{left}", markup=False)


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(
    src: Annotated[
        Path, typer.Argument(help="A Hugging Face GPT-2 folder holding vocab.json and merges.txt, or a tokenizer.json.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .tiktoken ranks file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
) -> None:
    """Write a GPT-2 folder's tokenizer (vocab.json + merges.txt, or tokenizer.json) as a .tiktoken file for
    --tokenizer-file.

    convert reads a GPT-2 folder's own tokenizer files by itself; this is for a nanoGPT checkpoint trained with
    GPT-2's tokenizer, whose ckpt.pt carries none.

    Examples:

      hf download openai-community/gpt2 vocab.json merges.txt --local-dir gpt2

      manas tokenizer gpt2 --out gpt2.tiktoken

      manas convert out/ckpt.pt --out mine.safetensors --tokenizer-file gpt2.tiktoken
    """

    run(src=src, out=out, force=force)
