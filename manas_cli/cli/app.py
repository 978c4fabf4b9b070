"""The manas command line, assembled: the app, its root options, and each command from its file in
cli/commands/ (its flags, help and call beside its body; the flags several commands share are cli/flags.py's).
A command imports the engine only when it runs, so `manas --help` answers without loading torch."""

from typing import Annotated

import typer

from .commands import (
    batch,
    bench,
    chat,
    convert,
    export,
    generate,
    inspect_cache,
    pull,
    quantize,
    rm,
    run,
    score,
    serve,
    tokenize,
    tokenizer,
    train,
)
from .commands import (
    list as list_,
)

app = typer.Typer(
    name="manas",
    help="Fast text generation from small GPT checkpoints, with a KV cache you can inspect.\n\n"
    "Examples:\n\n"
    "  manas generate --prompt 'ROMEO:'\n\n"
    "  echo 'To be' | manas generate -n 50 --json\n\n"
    "  manas bench\n\n"
    "  manas inspect-cache --tokens 32",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    """--version: the installed package's metadata, read without importing the engine (or torch)."""
    if value:
        from importlib.metadata import version

        print(f"manas {version('manas-cli')}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show the Python traceback of a failure.")] = False,
    version: Annotated[
        bool, typer.Option("--version", "-V", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Fast text generation from small GPT checkpoints, with a KV cache you can inspect."""
    # --debug is read once, by process.main, wherever it stands; it is declared here to be shown and accepted.


app.command("generate")(generate.command)
app.command("bench")(bench.command)
app.command(
    "inspect-cache",
)(inspect_cache.command)
app.command("score")(score.command)
app.command("serve")(serve.command)
app.command(
    "run",
)(run.command)
app.command("train", no_args_is_help=True)(train.command)
app.command("convert", no_args_is_help=True)(convert.command)
app.command("export", no_args_is_help=True)(export.command)
app.command("quantize", no_args_is_help=True)(quantize.command)
app.command("chat")(chat.command)
app.command("pull", no_args_is_help=True)(pull.command)
app.command(
    "list",
)(list_.command)
app.command("rm", no_args_is_help=True)(rm.command)
app.command(
    "tokenize",
)(tokenize.command)
app.command("tokenizer", no_args_is_help=True)(tokenizer.command)

batch_app = typer.Typer(
    name="batch",
    help="Generate or score every line of a JSONL file on a Ray cluster or a local Ray instance, each record what "
    "the line alone gives.\n\n"
    "The records are written in input order, to OUT.partial as they come and to OUT when all are there; --resume "
    "goes on after a killed job. Needs Ray: pip install 'manas-cli[ray]'. docs/scale.md has the details.\n\n"
    "Examples:\n\n"
    "  manas batch generate prompts.jsonl --out records.jsonl -n 64 -t 0\n\n"
    "  manas batch score corpus.jsonl --out scores.jsonl --ray 10.0.0.5:6379",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(batch_app)
batch_app.command("generate", no_args_is_help=True)(batch.generate_command)
batch_app.command("score", no_args_is_help=True)(batch.score_command)


def summarize_commands() -> None:
    """The top-level help lists each command with its docstring's first sentence whole (click would cut it at 45
    characters with '...'); a group of commands (batch) with its help's."""
    for info in [*app.registered_commands, *batch_app.registered_commands]:
        info.short_help = first_sentence(info.callback.__doc__)
    for group in app.registered_groups:
        group.short_help = first_sentence(group.typer_instance.info.help)


def first_sentence(text: str) -> str:
    first = " ".join(text.split("\n\n")[0].split())  # its lines joined, indents dropped
    return first.split(". ")[0].rstrip(".")


summarize_commands()
