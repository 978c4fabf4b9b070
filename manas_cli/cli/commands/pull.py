"""`manas pull`: a model from the Hugging Face Hub into the store (store.py), under a name."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ...errors import InputError
from ..flags import Quantization


def run(*, repo: str, name: str | None, quantize: str | None, force: bool, reuse: bool = False) -> str:
    """Download REPO[@REVISION]'s files that convert reads and convert them into the store under a name (a GGUF file
    is stored as it is published: its blocks run in place), and with --quantize store a quantized copy too
    (`NAME-int8`); the name. reuse: a model stored under that name already
    is the one wanted (`manas run OWNER/NAME` a second time), not refused."""
    from ... import store
    from ...formats.convert import convert_checkpoint
    from ..render import activity, stderr_console
    from . import quantize as quantize_command

    console = stderr_console()
    repository = store.parse_repo(repo)
    if repository.is_gguf and quantize is not None:
        raise InputError(
            f"{repo} is a GGUF repository: its quantized blocks already run as they are; pull it without --quantize"
        )
    if name is not None or not repository.is_gguf or repository.tag:  # the name is known: checked before downloading
        name = name or store.default_name(repository.name, repository.tag)
        if reuse and store.find(name) is not None:
            return name
        claim(name, quantize, force)
    if reuse:  # run's pull, on the way to the answer: say why it waits
        console.print(f"pulling {repo} from the Hugging Face Hub")
    if repository.is_gguf:
        source, tag = store.gguf_file(repository, progress=console.is_terminal)
    else:
        source, tag = store.download(repository.name, repository.revision, progress=console.is_terminal), None
    name = name or store.default_name(repository.name, tag)
    if reuse and store.find(name) is not None:
        return name
    out, copy = claim(name, quantize, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    if repository.is_gguf:  # as published: its blocks run in place, nothing to convert
        out = store.stored_path(name, store.GGUF_SUFFIX)
        with activity(console, pipe=False) as show:
            show(f"storing {source.name}")
            stored_copy(source, out)
        entry = store.describe(name, out, is_shipped=False)
        what, parameters = f"{entry.architecture}, {entry.weights}", entry.parameters
    else:
        with activity(console, pipe=False) as show:
            show(f"converting {source.name}")
            result = convert_checkpoint(source, out, force=force)
        what, parameters = result.source_kind, result.parameters
    for other in (store.stored_path(name, store.SUFFIX), store.stored_path(name, store.GGUF_SUFFIX)):
        if other != out:  # a model replaced by the other kind of file: its old copy goes
            other.unlink(missing_ok=True)
    pulled = f"{repo} ({source.name})" if repository.is_gguf else repo
    console.print(f"pulled {pulled}: {what}, {parameters:,} parameters, stored as {name} ({out})")
    if copy is not None:
        quantize_command.run(checkpoint=out, out=copy, kind=quantize, force=force)
    if reuse:
        return name
    if store.describe(name, out, is_shipped=False).chat_template:
        console.print(f"chat with it: manas chat -m {name}")
    else:
        console.print(f"run it: manas generate -m {name} -p 'Hello'")
    return name


def stored_copy(source: Path, out: Path) -> None:
    """The downloaded file into the store, whole or not at all: a hard link to the Hub cache's copy where both are on
    one file system (no second copy on disk), else a copy; written beside, then renamed over."""
    import os
    import shutil

    from ...files import atomic_write

    def write(tmp: str) -> None:
        os.unlink(tmp)
        try:
            os.link(os.path.realpath(source), tmp)
        except OSError:
            shutil.copyfile(source, tmp)

    atomic_write(out, write, overwrite=True)


def claim(name: str, quantize: str | None, force: bool):
    """The store paths of NAME (and of its quantized copy), refused where the name is the shipped model's or taken
    without --force."""
    from ... import store

    out = store.stored_path(name)
    copy = store.stored_path(f"{name}-{quantize}") if quantize else None
    for taken in (name, f"{name}-{quantize}" if quantize else None):
        if taken is not None and store.reserved(taken):
            raise InputError(f"{taken} is the name of the model shipped with manas: choose another with --name")
    for taken in (name, f"{name}-{quantize}" if quantize else None):
        if taken is not None and store.find(taken) is not None and not force:
            raise InputError(f"{taken} is in the store already: pass --force to replace it, or --name another")
    return out, copy


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(
    repo: Annotated[
        str,
        typer.Argument(
            help="A Hugging Face repository, OWNER/NAME[@REVISION]; a GGUF one as OWNER/NAME-GGUF[:QUANT] (the file "
            "of that quantization; Q4_K_M, else Q8_0, else the first by default)."
        ),
    ],
    name: Annotated[
        Optional[str], typer.Option(help="The store name. Default: the repository's name, lower case.")
    ] = None,
    quantize: Annotated[
        Optional[Quantization], typer.Option(help="Store an int8 or int4 copy too, as NAME-int8 or NAME-int4.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a stored model of that name.")] = False,
) -> None:
    """Download a model from the Hugging Face Hub and store it under a name that -m/-c take.

    Only the files convert reads are downloaded (config, safetensors weights, tokenizer, generation config, chat
    template; of a GGUF repository, the one file), into the Hugging Face cache ($HF_HOME; $HF_TOKEN, $HF_ENDPOINT
    and $HF_HUB_OFFLINE are honoured), so an interrupted pull resumes; the store is $MANAS_HOME (default
    ~/.local/share/manas). Needs the pull extra (huggingface_hub).

    Examples:

      manas pull HuggingFaceTB/SmolLM2-135M-Instruct

      manas pull Qwen/Qwen2.5-0.5B-Instruct --name qwen --quantize int8

      manas pull bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0

      manas generate -m smollm2-135m-instruct -p 'The capital of France is'
    """

    run(repo=repo, name=name, quantize=quantize.value if quantize else None, force=force)
