"""`manas export`: a checkpoint as a Hugging Face folder or a GGUF file."""

from __future__ import annotations

from pathlib import Path


def run(*, checkpoint: Path, out: Path, output_format: str, outtype: str | None, force: bool) -> None:
    from ..render import stderr_console

    if output_format == "gguf":
        from ...formats.gguf import export_gguf

        done = export_gguf(checkpoint, out, outtype=outtype or "f16", force=force)
        stderr_console().print(
            f"wrote a GGUF model (llama.cpp architecture {done.architecture}, {done.outtype}) to {done.out}: "
            f"{done.tensors} tensors, {done.size_bytes:,} bytes"
        )
        return
    if outtype is not None:
        import typer

        raise typer.BadParameter("--outtype applies to --format gguf only", param_hint="'--outtype'")
    from ...formats.huggingface import export_hf

    result = export_hf(checkpoint, out, force=force)
    stderr_console().print(
        f"wrote a Hugging Face {result.architecture} model to {result.out}: {', '.join(result.files)}"
    )
