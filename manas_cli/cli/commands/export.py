"""`manas export`: a checkpoint as a Hugging Face folder or a GGUF file."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..flags import CheckpointOption, ExportFormat, OutType


def run(*, checkpoint: Path, out: Path, output_format: str, outtype: str | None, force: bool) -> None:
    from ..render import activity, stderr_console

    if outtype is not None and output_format != "gguf":
        raise typer.BadParameter("--outtype applies to --format gguf only", param_hint="'--outtype'")
    if output_format == "gguf":
        from ...formats.gguf import export_gguf

        with activity(stderr_console(), pipe=False) as show:
            show(f"exporting {checkpoint.name} as GGUF")
            done = export_gguf(checkpoint, out, outtype=outtype or "f16", force=force)
        stderr_console().print(
            f"wrote a GGUF model (llama.cpp architecture {done.architecture}, {done.outtype}) to {done.out}: "
            f"{done.tensors} tensors, {done.size_bytes:,} bytes"
        )
        return
    from ...formats.hf_export import export_hf

    with activity(stderr_console(), pipe=False) as show:
        show(f"exporting {checkpoint.name} as a Hugging Face folder")
        result = export_hf(checkpoint, out, force=force)
    stderr_console().print(
        f"wrote a Hugging Face {result.architecture} model to {result.out}: {', '.join(result.files)}"
    )


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="hf: the folder to write (created, or with --force overwritten file by file); gguf: the .gguf file.",
        ),
    ],
    checkpoint: Annotated[
        Optional[Path],
        typer.Argument(help="manas checkpoint (.safetensors), or a store name (manas list).", show_default=False),
    ] = None,
    output_format: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help=(
                "hf: Hugging Face GPT-2 or Starcoder2 (transformers, vLLM, TGI); gguf: one file for llama.cpp and "
                "ollama."
            ),
        ),
    ] = ExportFormat.hf,
    outtype: Annotated[
        Optional[OutType],
        typer.Option("--outtype", help="gguf: the matrices' precision (default f16; vectors stay f32)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Write into a folder that is not empty, or over an existing file.")
    ] = False,
    model: CheckpointOption = None,
) -> None:
    """Export a checkpoint for the serving ecosystem: a Hugging Face folder with its tokenizer, or a GGUF file.

    --format hf writes config.json, generation_config.json, model.safetensors, vocab.json, merges.txt and
    tokenizer_config.json: GPT-2 for learned-position models, Starcoder2 for rotary (rope) ones. --format gguf writes
    one file with the tokenizer inside (llama.cpp's gpt2 or starcoder2; needs pip install "manas-cli[gguf]", or
    pip install -e ".[gguf]" in a clone).

    Examples:

      manas export model.safetensors --format hf --out model-hf

      vllm serve ./model-hf

      manas export model.safetensors --format gguf --out model.gguf

      llama-cli -m model.gguf -p "ROMEO:" -n 100
    """
    from .common import checkpoint_given

    run(
        checkpoint=checkpoint_given(checkpoint, model),
        out=out,
        output_format=output_format.value,
        outtype=outtype.value if outtype else None,
        force=force,
    )
