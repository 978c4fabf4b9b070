"""`manas convert`: nanoGPT, Hugging Face or GGUF weights as a manas checkpoint."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..flags import Quantization


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
    from ..render import activity, stderr_console

    with activity(stderr_console(), pipe=False) as show:
        show(f"converting {src}")
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


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(
    src: Annotated[
        Path,
        typer.Argument(
            help=(
                "nanoGPT ckpt.pt, a Hugging Face GPT-2, Starcoder2, Llama, Qwen2 or Mistral folder, a GGUF file "
                "(llama, qwen2, gpt2, starcoder2; any type llama.cpp quantizes to), or a bare model.safetensors "
                "(with --config)."
            )
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="manas checkpoint to write (.safetensors).")],
    config: Annotated[
        Optional[Path], typer.Option(help="Hugging Face GPT-2 or Starcoder2 config.json for a bare weights file.")
    ] = None,
    tokenizer: Annotated[
        str,
        typer.Option(
            help=(
                "'gpt2': GPT-2's BPE, from a folder's own vocab.json + merges.txt (or tokenizer.json), "
                "--tokenizer-file, or tiktoken's cache."
            )
        ),
    ] = "gpt2",
    tokenizer_file: Annotated[
        Optional[Path],
        typer.Option(
            help=(
                "GPT-2's ranks as a .tiktoken file, embedded in the checkpoint (`manas tokenizer` writes one from "
                "vocab.json + merges.txt)."
            )
        ),
    ] = None,
    tokenizer_meta: Annotated[
        Optional[Path], typer.Option(help="nanoGPT's character-level meta.pkl (read without running code).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    quantize: Annotated[
        Optional[Quantization],
        typer.Option(
            "--quantize",
            help="Write the matrices as manas' int8 (one scale per row) or int4 (a scale and a zero per 32 "
            "values), as `manas quantize` does; without it, float32 (a GGUF's blocks dequantized exactly).",
        ),
    ] = None,
) -> None:
    """Import nanoGPT, Hugging Face GPT-2, Starcoder2 or Llama-family (Llama, Qwen2, Mistral: SmolLM2, Qwen2.5)
    weights, or a llama.cpp GGUF file, as a manas checkpoint.

    Pickles are read with weights only: a file that would run code is refused. A GGUF brings its tokenizer, chat
    template and ends from its metadata.

    Examples:

      manas convert ckpt.pt --out char.safetensors --tokenizer-meta meta.pkl

      manas convert out/ckpt.pt --out mine.safetensors --tokenizer-file gpt2.tiktoken

      manas convert gpt2/ --out gpt2.safetensors

      manas convert SmolLM2-135M/ --out smollm2.safetensors

      manas convert model.safetensors --config config.json --out gpt2.safetensors

      manas convert SmolLM2-135M-Instruct-Q4_K_M.gguf --quantize int8 --out smollm2-int8.safetensors
    """

    run(
        src=src,
        out=out,
        config=config,
        tokenizer=tokenizer,
        tokenizer_file=tokenizer_file,
        tokenizer_meta=tokenizer_meta,
        force=force,
        quantize=quantize.value if quantize else None,
    )
