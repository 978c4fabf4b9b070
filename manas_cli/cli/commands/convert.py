"""`manas convert`: nanoGPT, Hugging Face or GGUF weights as a manas checkpoint."""

from __future__ import annotations

from pathlib import Path


def run(
    *,
    src: Path,
    out: Path,
    config: Path | None,
    tokenizer: str,
    tokenizer_file: Path | None,
    tokenizer_meta: Path | None,
    force: bool,
    quantize: str | None,
) -> None:
    from ...formats.convert import convert_checkpoint
    from ..render import stderr_console

    result = convert_checkpoint(
        src,
        out,
        config_path=config,
        tokenizer=tokenizer,
        tokenizer_file=tokenizer_file,
        tokenizer_meta=tokenizer_meta,
        force=force,
        quantize=quantize,
    )
    shape = result.config
    stderr_console().print(
        f"converted the {result.source_kind} {src}: {result.parameters:,} parameters "
        f"(n_layer={shape.n_layer}, n_head={shape.n_head}, n_embd={shape.n_embd}, block_size={shape.block_size}, "
        f"vocab_size={shape.vocab_size}, bias={shape.bias}), tokenizer: {result.tokenizer}"
        f"{f', weights as {quantize}' if quantize else ''}\nwrote {out}"
    )
