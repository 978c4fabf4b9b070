"""The manas command line. Flags and help live here; each command imports the engine only when it runs,
so `manas --help` answers without loading torch."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import ManasError

app = typer.Typer(
    name="manas",
    help="Fast text generation from small GPT checkpoints, with a KV cache you can inspect.\n\n"
    "Examples:\n\n"
    "  manas generate --prompt 'ROMEO:'\n\n"
    "  echo 'To be' | manas generate -n 50 --json\n\n"
    "  manas bench --tokens 256\n\n"
    "  manas inspect-cache --tokens 32",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class PositionEncoding(str, Enum):
    learned = "learned"
    rope = "rope"


DeviceOption = Annotated[Device, typer.Option(help="auto: CUDA when available, else the CPU.")]
ThreadsOption = Annotated[Optional[int], typer.Option(min=1, help="CPU threads for torch (default: torch's choice).")]


@app.callback()
def root(debug: Annotated[bool, typer.Option("--debug", help="Show the Python traceback of a failure.")] = False) -> None:
    """Fast text generation from small GPT checkpoints, with a KV cache you can inspect."""


@app.command(no_args_is_help=True)
def train(
    text_file: Annotated[Path, typer.Argument(help="UTF-8 training text; its last --val-fraction is held out.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Checkpoint to write (.safetensors), or ranks file with --tokenizer-only.")],
    n_layer: Annotated[int, typer.Option(min=1, help="Transformer blocks.")] = 6,
    n_head: Annotated[int, typer.Option(min=1, help="Query heads per block.")] = 8,
    n_kv_head: Annotated[Optional[int], typer.Option(min=1, help="Key/value heads (fewer than --n-head: grouped-query attention).")] = 2,
    n_embd: Annotated[int, typer.Option(min=1, help="Width of the residual stream.")] = 256,
    block_size: Annotated[int, typer.Option(min=2, help="Context window in tokens.")] = 256,
    position_encoding: Annotated[PositionEncoding, typer.Option(help="rope (rotary) or learned (GPT-2's table).")] = PositionEncoding.rope,
    vocab_size: Annotated[int, typer.Option(min=257, help="Size of the byte-level BPE trained on the text.")] = 2048,
    tokenizer: Annotated[str, typer.Option(help="'bpe': train one on the text; 'gpt2': use --tokenizer-file's ranks.")] = "bpe",
    tokenizer_file: Annotated[Optional[Path], typer.Option(help="A .tiktoken ranks file (with --tokenizer gpt2).")] = None,
    tokenizer_only: Annotated[bool, typer.Option(help="Train the BPE and write its .tiktoken ranks to --out; no model.")] = False,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps in all (a resumed run continues to this).")] = 2500,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences of block_size tokens per step.")] = 16,
    lr: Annotated[float, typer.Option(min=0.0, help="Peak learning rate (AdamW, linear warm-up, cosine decay to lr/10).")] = 1.5e-3,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Steps of linear learning-rate warm-up.")] = 100,
    dropout: Annotated[float, typer.Option(min=0.0, max=0.99, help="Dropout probability while training.")] = 0.1,
    eval_every: Annotated[int, typer.Option(min=1, help="Steps between validation (and best-checkpoint saves).")] = 250,
    seed: Annotated[int, typer.Option(help="Seed for initialization and batch sampling.")] = 1337,
    val_fraction: Annotated[float, typer.Option(min=0.001, max=0.5, help="Held-out tail of the text for validation.")] = 0.1,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint at --out (its weights and step; fresh optimizer moments).")] = False,
    device: DeviceOption = Device.auto,
    threads: ThreadsOption = None,
) -> None:
    """Train a GPT (and its byte-level BPE) on a text file, saving the best-validation checkpoint.

    Examples:

      manas train ../shared/data/tinyshakespeare.txt --out checkpoints/shakespeare.safetensors

      manas train input.txt --out tiny.safetensors --n-layer 2 --n-embd 64 --steps 200

      manas train input.txt --out bpe.tiktoken --tokenizer-only --vocab-size 4096
    """
    from . import commands

    commands.train(**locals())


def main() -> None:
    """Entry point: run the app, turning every expected failure into one `error:` line and an exit code."""
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort, Exit

    from .render import error_line

    debug = "--debug" in sys.argv[1:]
    command = typer.main.get_command(app)
    try:
        command.main(sys.argv[1:], prog_name="manas", standalone_mode=False)
    except Exit as exc:
        sys.exit(exc.exit_code)
    except ClickException as exc:
        _fail(error_line(exc.format_message()), exc.exit_code, debug)
    except (KeyboardInterrupt, Abort):
        _fail("error: interrupted", 130, debug)
    except BrokenPipeError:
        _quiet_broken_pipe()
    except ManasError as exc:
        _fail(error_line(str(exc)), 1, debug)
    except Exception as exc:
        _fail(error_line(f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)"), 1, debug)


def _fail(line: str, code: int, debug: bool) -> None:
    if debug:
        import traceback

        traceback.print_exc()
    print(line, file=sys.stderr)
    sys.exit(code)


def _quiet_broken_pipe() -> None:
    """The reader went away (`| head`): exit quietly, and keep Python from complaining at shutdown."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(141)
