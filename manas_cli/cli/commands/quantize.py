"""`manas quantize`: an int8 or int4 copy of a float checkpoint."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..flags import CheckpointOption

KEPT_METADATA = ("chat_template", "converted_from")  # what the quantized copy still is: its chat, its source


def run(*, checkpoint: Path, out: Path, kind: str, force: bool) -> None:
    from ...files import check_output_file
    from ...formats.checkpoint import load_checkpoint, save_checkpoint
    from ...models import quantize_checkpoint
    from ..render import activity, stderr_console

    check_output_file(out, force, inputs=(checkpoint,))
    with activity(stderr_console(), pipe=False) as show:
        show(f"quantizing {checkpoint.name} to {kind}")
        loaded = load_checkpoint(checkpoint)
        quantize_checkpoint(loaded, kind, "there is nothing to quantize")
        kept = {key: value for key, value in (loaded.metadata or {}).items() if key in KEPT_METADATA}
        save_checkpoint(out, loaded.model, loaded.tokenizer_spec, kept, overwrite=force)
    stderr_console().print(
        f"quantized {checkpoint} to {kind}: {checkpoint.stat().st_size:,} → {out.stat().st_size:,} bytes\nwrote {out}"
    )


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def bits_in_range(value: int) -> int:
    if value not in (8, 4):
        raise typer.BadParameter(f"{value} is not a supported width: use 8 (int8) or 4 (int4)")
    return value


def command(
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out",
            "-o",
            help="Quantized checkpoint to write (.safetensors). Default, for a store name: the store, as NAME-int8 "
            "(or NAME-int4).",
            show_default=False,
        ),
    ] = None,
    checkpoint: Annotated[
        Optional[Path],
        typer.Argument(
            help="float manas checkpoint (.safetensors) to quantize, or a store name (manas list).", show_default=False
        ),
    ] = None,
    bits: Annotated[
        int,
        typer.Option(
            "--bits",
            callback=bits_in_range,
            help="8: int8, one scale per row, about 4× "
            "smaller; 4: int4, a scale and a zero per 32 values, about 6× smaller.",
        ),
    ] = 8,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    model: CheckpointOption = None,
) -> None:
    """Write a quantized copy of a checkpoint: its matrices as int8 (--bits 8) or int4 (--bits 4).

    generate, bench, inspect-cache, score and export load it without any flag; it computes what --quantize int8
    or int4 does, except that the token embedding too is read back from its quantized rows.

    Examples:

      manas quantize gpt2.safetensors --out gpt2-int8.safetensors

      manas quantize gpt2.safetensors --bits 4 --out gpt2-int4.safetensors

      manas quantize smollm2-135m-instruct --bits 4      # stored as smollm2-135m-instruct-int4

      manas generate -c gpt2-int4.safetensors -p 'Hello'
    """
    from ...errors import InputError
    from .common import checkpoint_given

    path, kind = checkpoint_given(checkpoint, model), f"int{bits}"
    if path.suffix == ".gguf":
        raise InputError(
            f"{path.name} is a GGUF file: its quantized blocks already run as they are (manas generate -m {path}); "
            "for manas' own int8 or int4, convert it first (manas convert FILE.gguf --out FILE.safetensors)"
        )
    run(checkpoint=path, out=out or stored_copy(checkpoint or model, path, kind), kind=kind, force=force)


def stored_copy(given: Path | None, path: Path, kind: str) -> Path:
    """Where a quantized copy goes without --out: into the store as NAME-int8 where a store name was given (as pull
    --quantize stores it); a file needs --out."""
    from ... import store

    if given is not None and store.find(str(given)) == path and not store.reserved(str(given)):
        return store.stored_path(f"{given}-{kind}")
    raise typer.BadParameter(
        "give the quantized file's path: --out FILE (a store name's copy goes into the store by itself)",
        param_hint="'--out'",
    )
