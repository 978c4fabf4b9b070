"""Writing the user's files safely: whole or not at all, and never over a file they did not ask us to replace."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from .errors import InputError, OutputExistsError

# Temporary files of writes in progress. A signal can land between creating one and the `try` that removes it, or
# inside that clean-up itself; the CLI removes whatever is left here on its way out.
_unfinished: set[str] = set()


def atomic_write(path: str | Path, write: Callable[[str], None], *, overwrite: bool) -> None:
    """Call write(temporary_path) in path's folder, then move the finished file into place.

    A crash or a signal never leaves a partial file (the temporary file is removed on any exception; the CLI turns
    SIGTERM into one). Without overwrite, the name is claimed with a hard link, which fails if it exists: of two
    writers racing for one name, exactly one wins and the other gets OutputExistsError, nothing replaced.
    """
    path = Path(path)
    tmp = _create_temporary(path)
    try:
        try:
            write(tmp)
        except OSError as exc:
            if exc.errno is None and _disk_full(path.parent):  # a short write reported without errno (numpy's)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
            raise
        publish(tmp, path, overwrite=overwrite)
    finally:
        Path(tmp).unlink(missing_ok=True)
        _unfinished.discard(tmp)


def publish(finished: str | Path, path: Path, *, overwrite: bool) -> None:
    """Give a finished file, written private beside path, path's name and an ordinary file's mode: replacing path
    (overwrite), or claiming the name with a hard link, which fails if it exists (the caller removes `finished`)."""
    os.chmod(finished, _new_file_mode())  # created private (0600) while being written
    if overwrite:
        refuse_special(path)  # checked before the work too; a device may have appeared meanwhile
        os.replace(finished, path)
    else:
        _claim(str(finished), path)


def remove_unfinished() -> None:
    """Remove the temporary files that interrupted writes left (see _unfinished); the CLI calls this last."""
    for tmp in list(_unfinished):
        Path(tmp).unlink(missing_ok=True)
        _unfinished.discard(tmp)


def check_output_file(path: Path, overwrite: bool, *, inputs: tuple[Path | None, ...] = ()) -> None:
    """Before any work: --out names a file (not a folder) in a folder that exists, is none of the files the command
    reads (even with overwrite), and is new unless overwrite, which replaces a regular file only."""
    if len(os.fsencode(path.name)) > NAME_MAX:
        raise InputError(
            f"--out {path}: the file name is {len(os.fsencode(path.name))} bytes long, and a name may "
            f"have at most {NAME_MAX}: choose a shorter one"
        )
    if path.is_dir():
        raise InputError(f"--out {path} is a folder: name the file to write inside it")
    if not path.parent.is_dir():
        raise InputError(f"the folder of --out {path} does not exist")
    refuse_inputs(path, inputs)
    refuse_existing(path, overwrite)
    refuse_special(path)


def refuse_inputs(path: Path, inputs: tuple[Path | None, ...]) -> None:
    """path is none of the files a command reads: compared by identity (os.path.samefile), so another spelling of
    the name or a link to the file is caught too."""
    for source in inputs:
        if source is not None and _same_file(path, source):
            raise InputError(
                f"--out {path} is the input file {source}, which the command reads: name another file to write"
            )


def refuse_special(path: str | Path) -> None:
    """--force replaces regular files only: never a device, a pipe or a socket (as root, /dev/null itself)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (or a dangling link, which the new file replaces)
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        kind = (
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a pipe" if stat.S_ISFIFO(mode) else "a socket"
        )
        raise InputError(
            f"--out {path} is {kind}, not a regular file: --force replaces regular files only; name a file"
        )


def claim_folder(staging: Path, path: Path) -> None:
    """Rename a finished staging folder to path, which may only be missing or empty: the rename fails if path holds
    anything, so of two writers racing for one folder exactly one wins and the other gets OutputExistsError."""
    try:
        os.rename(staging, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise OutputExistsError(
            f"{path} exists and is not empty (written by another process meanwhile?): "
            "pass --force to overwrite its files"
        ) from None


def refuse_existing(path: str | Path, overwrite: bool) -> None:
    """Fail early (before any work) when path exists and may not be replaced; atomic_write checks again at the end."""
    if not overwrite and os.path.lexists(path):
        raise OutputExistsError(f"{path} exists: pass --force to overwrite it")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # the same inode: also through a link or another spelling of the path
    except OSError:  # either does not exist (yet)
        return False


def temporary_name(name: str) -> str:
    """`.NAME.RANDOM.tmp`, NAME cut so that the whole stays within the 255 bytes a file name may have."""
    suffix = f".{os.urandom(8).hex()}.tmp"
    room = NAME_MAX - 1 - len(suffix)
    return "." + os.fsencode(name)[:room].decode(errors="ignore") + suffix


NAME_MAX = 255  # bytes in one file name, on every file system manas writes to


def _create_temporary(path: Path) -> str:
    """An empty private file (temporary_name) beside path, recorded in _unfinished before it exists."""
    tmp = str(path.parent / temporary_name(path.name))
    _unfinished.add(tmp)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        _unfinished.discard(tmp)  # not ours (or not created): never to be removed
        raise
    return tmp


def _disk_full(folder: Path) -> bool:
    """Whether the file system of folder has (next to) no space left for an ordinary user."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize < 2**20


def _claim(tmp: str, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExistsError(
            f"{path} exists (written by another process meanwhile?): pass --force to overwrite it"
        ) from None


def _new_file_mode() -> int:
    """What open() would give a new file: 0666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
