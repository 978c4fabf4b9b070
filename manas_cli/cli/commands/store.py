"""`manas pull`, `manas list` and `manas rm`: the model store (store.py), by name."""

from __future__ import annotations

import json

from ...errors import InputError


def pull(*, repo: str, name: str | None, quantize: str | None, force: bool) -> None:
    """Download REPO[@REVISION]'s files that convert reads, convert them into the store under a name, and with
    --quantize store a quantized copy too (`NAME-int8`)."""
    from ... import store
    from ...formats.convert import convert_checkpoint
    from ..render import stderr_console
    from . import quantize as quantize_command

    console = stderr_console()
    repository = store.parse_repo(repo)
    if name is not None or not repository.is_gguf or repository.tag:  # the name is known: checked before downloading
        claim(name or store.default_name(repository.name, repository.tag), quantize, force)
    if repository.is_gguf:
        source, tag = store.gguf_file(repository, progress=console.is_terminal)
    else:
        source, tag = store.download(repository.name, repository.revision, progress=console.is_terminal), None
    name = name or store.default_name(repository.name, tag)
    out, copy = claim(name, quantize, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = convert_checkpoint(source, out, force=force)
    pulled = f"{repo} ({source.name})" if repository.is_gguf else repo
    console.print(f"pulled {pulled}: {result.source_kind}, {result.parameters:,} parameters, stored as {name} ({out})")
    if copy is not None:
        quantize_command.run(checkpoint=out, out=copy, kind=quantize, force=force)
    if store.describe(name, out, is_shipped=False).chat_template:
        console.print(f"chat with it: manas chat -m {name}")
    else:
        console.print(f"run it: manas generate -m {name} -p 'Hello'")


def claim(name: str, quantize: str | None, force: bool):
    """The store paths of NAME (and of its quantized copy), refused where the name is the shipped model's or taken
    without --force."""
    from ... import store

    out = store.stored_path(name)
    copy = store.stored_path(f"{name}-{quantize}") if quantize else None
    for taken in (name, f"{name}-{quantize}" if quantize else None):
        if taken is not None and store.reserved(taken):
            raise InputError(f"{taken} is the name of the model shipped with manas: choose another with --name")
    for path in (out, copy):
        if path is not None and path.exists() and not force:
            raise InputError(f"{path.stem} is in the store already: pass --force to replace it, or --name another")
    return out, copy


def list_models(*, as_json: bool) -> None:
    from ... import store
    from ..render import plain_table

    entries = store.entries()
    if as_json:
        print(json.dumps([_as_dict(entry) for entry in entries], indent=2))
        return
    rows = [
        [
            entry.name + (" (shipped)" if entry.shipped else ""),
            entry.architecture,
            f"{entry.parameters / 1e6:,.1f}M",
            entry.weights,
            f"{entry.size_bytes / 2**20:,.1f} MiB",
            f"{entry.window:,}",
            "yes" if entry.chat_template else "no",
        ]
        for entry in entries
    ]
    print(plain_table(["NAME", "ARCHITECTURE", "PARAMETERS", "WEIGHTS", "SIZE", "WINDOW", "CHAT"], rows))


def remove(*, name: str) -> None:
    from ... import store
    from ..render import stderr_console

    path = store.remove(name)
    stderr_console().print(f"removed {name} ({path})")


def _as_dict(entry) -> dict:
    return {**entry.__dict__, "path": str(entry.path)}
