"""Writing the user's files safely: whole or not at all, and never over a file they did not ask us to replace."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import OutputExistsError


def atomic_write(path: str | Path, write: Callable[[str], None], *, overwrite: bool) -> None:
    """Call write(temporary_path) in path's folder, then move the finished file into place.

    A crash or a signal never leaves a partial file (the temporary file is removed on any exception; the CLI turns
    SIGTERM into one). Without overwrite, the name is claimed with a hard link, which fails if it exists: of two
    writers racing for one name, exactly one wins and the other gets OutputExistsError, nothing replaced.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _new_file_mode())  # mkstemp makes it private (0600); the result is an ordinary file
        if overwrite:
            os.replace(tmp, path)
        else:
            _claim(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def refuse_existing(path: str | Path, overwrite: bool) -> None:
    """Fail early (before any work) when path exists and may not be replaced; atomic_write checks again at the end."""
    if not overwrite and os.path.lexists(path):
        raise OutputExistsError(f"{path} exists: pass --force to overwrite it")


def _claim(tmp: str, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExistsError(f"{path} exists (written by another process meanwhile?): pass --force to overwrite it") from None


def _new_file_mode() -> int:
    """What open() would give a new file: 0666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
