"""`manas quantize`: an int8 or int4 copy of a float checkpoint."""

from __future__ import annotations

from pathlib import Path

from ...files import check_output_file
from ...models import quantize_checkpoint

KEPT_METADATA = ("chat_template", "converted_from")  # what the quantized copy still is: its chat, its source


def run(*, checkpoint: Path, out: Path, kind: str, force: bool) -> None:
    from ...formats.checkpoint import load_checkpoint, save_checkpoint
    from ..render import stderr_console

    check_output_file(out, force, inputs=(checkpoint,))
    loaded = load_checkpoint(checkpoint)
    quantize_checkpoint(loaded, kind, "there is nothing to quantize")
    kept = {key: value for key, value in (loaded.metadata or {}).items() if key in KEPT_METADATA}
    save_checkpoint(out, loaded.model, loaded.tokenizer_spec, kept, overwrite=force)
    stderr_console().print(
        f"quantized {checkpoint} to {kind}: {checkpoint.stat().st_size:,} → {out.stat().st_size:,} bytes\nwrote {out}"
    )
