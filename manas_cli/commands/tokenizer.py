"""`manas tokenizer`: a Hugging Face folder's GPT-2 tokenizer files (vocab.json, merges.txt) as a .tiktoken file."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..files import check_output_file


def run(*, src: Path, out: Path, force: bool) -> None:
    from ..convert import HF_MERGES, HF_VOCAB, folder_tokenizer
    from ..files import atomic_write
    from ..render import stderr_console
    from ..tokenizer import decode_ranks

    check_output_file(out, force, inputs=(src / HF_VOCAB, src / HF_MERGES))
    found = folder_tokenizer(src) if src.is_dir() else None
    if found is None:
        raise InputError(f"{src} is not a folder holding GPT-2's {HF_VOCAB} and {HF_MERGES}")
    ranks_text = found[1]["ranks"]
    atomic_write(out, lambda tmp: Path(tmp).write_text(ranks_text, encoding="ascii"), overwrite=force)
    stderr_console().print(f"wrote {len(decode_ranks(ranks_text)):,} BPE ranks from {src} to {out}")
