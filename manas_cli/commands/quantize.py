"""`manas quantize`: an int8 copy of a float checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..files import check_output_file
from .common import quantize_checkpoint


def run(*, checkpoint: Path, out: Path, force: bool) -> None:
    from ..checkpoint import load_checkpoint, save_checkpoint
    from ..render import stderr_console

    check_output_file(out, force, inputs=(checkpoint,))
    loaded = load_checkpoint(checkpoint)
    quantize_checkpoint(loaded, "there is nothing to quantize")
    save_checkpoint(out, loaded.model, loaded.tokenizer_spec, overwrite=force)
    stderr_console().print(
        f"quantized {checkpoint} to int8: {checkpoint.stat().st_size:,} → {out.stat().st_size:,} bytes\nwrote {out}"
    )
