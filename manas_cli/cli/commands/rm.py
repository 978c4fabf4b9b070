"""`manas rm`: a model removed from the store (store.py)."""

from typing import Annotated

import typer


def run(*, name: str) -> None:
    from ... import store
    from ..render import stderr_console

    path = store.remove(name)
    stderr_console().print(f"removed {name} ({path})")


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(name: Annotated[str, typer.Argument(help="A store name (manas list).")]) -> None:
    """Remove a model from the store ($MANAS_HOME); the shipped model stays.

    Examples:

      manas rm smollm2-135m-instruct-int8
    """

    run(name=name)
