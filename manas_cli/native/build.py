"""The C core, compiled on first use with the system's compiler and loaded with ctypes.

Nothing is compiled at install time: `pip install` needs no compiler. The first run that wants the core compiles
core.c (`$CC`, else `cc`; it includes its rooms from core/, one translation unit) into a per-user cache folder,
`$XDG_CACHE_HOME/manas` else `~/.cache/manas`, under a name keyed by a hash of every source file, the flags, the
compiler (its file and modification time) and the CPU's features, so an upgrade of any of them builds afresh and
two machines sharing a home folder never load each other's code.

A shared library is code. One is loaded only from a folder the user owns and no one else can write, below folders
no one else can rename it out of (every ancestor owned by the user or root and writable by no one else, sticky
folders such as /tmp aside: ssh's StrictModes rule), only if it is a regular file the user owns and no one else can
write, and only from the file descriptor that was checked and hashed, so nothing can be swapped in between. A cache
folder that fails those checks is refused with one notice, and the core is built in one private folder per user in
the system's temporary folder instead, reused by every later run.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .binding import declare

SOURCE = Path(__file__).with_name("core.c")  # what the compiler is given: it includes every file of core/
# Every file the library is built from, in a fixed order: the cache key hashes them all.
SOURCES = (SOURCE, *sorted(SOURCE.with_name("core").glob("*.c")))
# -ffp-contract=off: every multiply and add as written, so the core's order of arithmetic is its source's
# (core.c, "dots"); the lanes it writes out let the compiler vectorize without reassociating anything.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden")
LIBRARIES = ("-lm",)
ABI_VERSION = 10  # core.c's MANAS_ABI_VERSION: a library of another version is never used
# The core compiles in 5-20 s (a minute or more beside other builds on a busy 2-core machine, or under the
# sanitizers): one still running after five minutes has hung.
COMPILE_TIMEOUT_S = 300
FAILURE_BYTES = 1 << 16  # a remembered failure's reason and compiler message: never read further
DIGEST_BYTES = 65  # a SHA-256 in hex and a newline: a digest file is never read further


class NativeUnavailable(Exception):
    """The core cannot run here; `reason` says why in a few words, `detail` is the compiler's own message."""

    def __init__(self, reason: str, detail: str = "", notify: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail
        self.notify = notify  # say so even when the engine was not asked for by name (a library that failed its test)


@dataclass(frozen=True)
class Built:
    library: ctypes.CDLL  # its entry points declared (binding.declare)
    path: Path
    compile_s: float | None  # seconds this process spent compiling it, None when it was cached
    notice: str | None  # a cache folder refused, and why


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "manas"


def fallback_folder() -> Path:
    """The one folder per user the core is built in when the cache folder cannot be trusted or written."""
    return Path(tempfile.gettempdir()) / f"manas-native-{os.getuid()}"


def compiler() -> str:
    name = os.environ.get("CC") or "cc"
    path = shutil.which(name)
    if path is None:
        raise NativeUnavailable(f"no C compiler ({'$CC=' + name if os.environ.get('CC') else 'cc'} not found)")
    return path


def compiler_identity(cc: str) -> str:
    """The compiler as the key knows it: its resolved file, size and modification time, which an upgrade changes.
    (Not `cc --version`: a process at every start, for what a stat tells.)"""
    real = os.path.realpath(cc)
    info = os.stat(real)
    return f"{real} {info.st_size} {info.st_mtime_ns}"


def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and flags (Linux), else the platform's description."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def library_name(cc: str) -> str:
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in SOURCES),
        " ".join(FLAGS + LIBRARIES).encode(),
        compiler_identity(cc).encode(),
        cpu_features().encode(),
    ):
        key.update(hashlib.sha256(part).digest())
    return f"core-{key.hexdigest()[:24]}.so"


def unsafe_reason(info: os.stat_result) -> str | None:
    """Why a folder or file (its lstat or fstat) must not be trusted with code: not ours, or writable by others."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid != os.getuid():
        return "is not owned by you"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "can be written by other users"
    return None


def unsafe_ancestor(folder: Path) -> str | None:
    """Why a folder above `folder` (as written, and once links are resolved) would let another user rename or
    replace it, or None: one not owned by the user or root, or writable by others without the sticky bit."""
    absolute = Path(os.path.abspath(folder))
    for parent in dict.fromkeys([*absolute.parents, *Path(os.path.realpath(absolute)).parents]):
        info = parent.stat()
        if info.st_uid not in (0, os.getuid()):
            return f"{parent}, which is not owned by you or root"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            return f"{parent}, which can be written by other users"
    return None


def folder_problem(folder: Path) -> str | None:
    """Why `folder` (created for the user alone if missing) cannot hold the core, in words after its name."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if (reason := unsafe_reason(folder.lstat())) is not None:
            return reason
        if (ancestor := unsafe_ancestor(folder)) is not None:
            return f"is inside {ancestor}"
        return None
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"


def private_folder(folder: Path) -> tuple[Path, str | None]:
    """folder, or the user's fallback folder when folder cannot be trusted (with the notice that says why)."""
    if (reason := folder_problem(folder)) is None:
        return folder, None
    return fallback(f"{folder} {reason}")


def fallback(why: str) -> tuple[Path, str]:
    folder = fallback_folder()
    if (reason := folder_problem(folder)) is not None:
        raise NativeUnavailable(f"{why}, and {folder} {reason}")
    return folder, f"{why}: the native core is built in {folder} instead"


def open_trusted(path: Path) -> int | None:
    """A descriptor of `path` if it is a regular file the user owns and no one else can write, else None. Opened
    without blocking and without following a link, so a FIFO or a link planted under the name is never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or unsafe_reason(info) is not None:
        os.close(fd)
        return None
    return fd


def read_all(fd: int, limit: int | None = None) -> bytes:
    with os.fdopen(os.dup(fd), "rb") as f:
        return f.read(limit if limit is not None else -1)


@contextmanager
def locked(target: Path) -> Iterator[None]:
    """The target's lock held, and its temporaries that a killed or failed run left behind removed (only a run
    holding the lock creates them, so any found now are stale)."""
    lock = target.with_name(f"{target.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NativeUnavailable(f"{lock} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        for stale in (*target.parent.glob(f".build-{target.name}-*"), *target.parent.glob(f".digest-{target.name}-*")):
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)


def run_compiler(command: list[str]) -> subprocess.CompletedProcess:
    """command run in its own process group, all of which is killed if it outlives COMPILE_TIMEOUT_S (a compiler
    driver that hangs leaves no child behind)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=COMPILE_TIMEOUT_S)
    except BaseException:  # the timeout, or ^C while compiling
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def compile_library(cc: str, target: Path) -> float:
    """Compile core.c into target atomically (a temporary name, then a rename); the seconds it took."""
    started = time.perf_counter()
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".build-{target.name}-", suffix=".so")
    os.close(fd)
    try:
        try:
            result = run_compiler([cc, *FLAGS, "-o", temporary, str(SOURCE), *LIBRARIES])
        except subprocess.TimeoutExpired:
            raise NativeUnavailable(
                f"the C compiler {cc} was still running after {COMPILE_TIMEOUT_S} s, so it was stopped"
            ) from None
        except OSError as exc:
            raise NativeUnavailable(f"the C compiler {cc} failed", str(exc)) from None
        if result.returncode:
            raise NativeUnavailable(f"the C compiler {cc} failed on the native core", result.stderr)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return time.perf_counter() - started


def load(fd: int, path: Path) -> ctypes.CDLL:
    """The library open on `fd`, loaded through the descriptor itself (Linux's /proc/self/fd) and declared; a
    library of another version, or one missing an entry point, is refused and unloaded (the dynamic loader answers
    a name it holds with what it holds, so a refused library left loaded would shadow its rebuild)."""
    name = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
    try:
        library = ctypes.CDLL(name)
    except OSError as exc:
        raise NativeUnavailable("the native core does not load", str(exc)) from None
    try:
        if library.manas_abi_version() != ABI_VERSION:
            raise NativeUnavailable("the native core's library is of another version")
        return declare(library)
    except (AttributeError, NativeUnavailable) as exc:
        unload(library)
        if isinstance(exc, NativeUnavailable):
            raise
        raise NativeUnavailable("the native core's library lacks an entry point", str(exc)) from None


def unload(library: ctypes.CDLL) -> None:
    import _ctypes

    _ctypes.dlclose(library._handle)


def build(on_compile: Callable[[], None] | None = None) -> Built:
    """The loaded core, compiled first if this source, compiler and CPU have no library in the cache yet, or the
    cached one is not the one compiled (truncated, corrupted, replaced) or does not load: it is then rebuilt.
    Concurrent first runs take turns on a lock: one compiles, the others load what it built. on_compile() is
    called just before a compile starts (to say so on a terminal). A cache folder that cannot be trusted or
    written is replaced by the user's fallback folder, with a notice."""
    cc = compiler()
    name = library_name(cc)
    folder, notice = private_folder(cache_folder())
    try:
        return _build_in(cc, folder / name, notice, on_compile)
    except OSError as exc:  # the folder is ours but not writable (a read-only home, a full disk)
        if folder == fallback_folder():
            raise NativeUnavailable(f"{folder} cannot be written ({exc.strerror or exc})") from None
        folder, notice = fallback(f"{folder} cannot be written ({exc.strerror or exc})")
        return _build_in(cc, folder / name, notice, on_compile)


def _build_in(cc: str, target: Path, notice: str | None, on_compile: Callable[[], None] | None) -> Built:
    digest = target.with_name(f"{target.name}.sha256")
    failed = target.with_name(f"{target.name}.failed")
    with locked(target):
        if (library := cached(target, digest)) is not None:
            return Built(library, target, None, notice)
        if (remembered := remembered_failure(failed)) is not None:
            raise remembered
        if on_compile is not None:
            on_compile()
        try:
            return _compile_and_load(cc, target, digest, notice)
        except NativeUnavailable as exc:  # this source, compiler and CPU fail: no later run waits on them again
            remember_failure(target, failed, exc)
            raise


def _compile_and_load(cc: str, target: Path, digest: Path, notice: str | None) -> Built:
    compile_s = compile_library(cc, target)
    fd = open_trusted(target)
    if fd is None:
        raise NativeUnavailable(f"{target} changed as it was built")
    try:
        code = read_all(fd)
        library = load(fd, target)
    finally:
        os.close(fd)
    if failure := self_test(library):  # kept (its digest written) only once it has passed
        unload(library)
        target.unlink()
        raise NativeUnavailable(
            f"the freshly built core failed its self-test ({failure}), so it was deleted", notify=True
        )
    write_beside(target, digest, hashlib.sha256(code).hexdigest() + "\n")
    return Built(library, target, compile_s, notice)


def remembered_failure(failed: Path) -> NativeUnavailable | None:
    """An earlier run's failure to build this library (the key names the source, flags, compiler and CPU), if one
    was written; the reason says how to try again."""
    fd = open_trusted(failed)
    if fd is None:
        return None
    try:
        record = json.loads(read_all(fd, FAILURE_BYTES))
        reason, detail, notify = str(record["reason"]), str(record["detail"]), bool(record["notify"])
    except (ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
    return NativeUnavailable(f"{reason} (in an earlier run: delete {failed} to try again)", detail, notify)


def remember_failure(target: Path, failed: Path, exc: NativeUnavailable) -> None:
    record = {"reason": exc.reason, "detail": exc.detail[: FAILURE_BYTES // 2], "notify": exc.notify}
    write_beside(target, failed, json.dumps(record))


def cached(target: Path, digest: Path) -> ctypes.CDLL | None:
    """The cached library, loaded, if it is the one compiled byte for byte (loading a truncated or corrupted shared
    library kills the process with SIGBUS before any error could be caught) and it loads; else None: rebuild it."""
    fd, digest_fd = open_trusted(target), open_trusted(digest)
    try:
        if fd is None or digest_fd is None:
            return None
        expected = read_all(digest_fd, DIGEST_BYTES).decode("ascii", errors="replace").strip()
        if hashlib.sha256(read_all(fd)).hexdigest() != expected:
            return None
        try:
            return load(fd, target)
        except NativeUnavailable:
            return None
    finally:
        for open_fd in (fd, digest_fd):
            if open_fd is not None:
                os.close(open_fd)


def self_test(library: ctypes.CDLL) -> str | None:
    """What a newly built library gets wrong of a few known answers, or None: Philox4x32-10's first known-answer
    vector (Random123's; integer arithmetic the compiler must keep), NaN and infinity found where they are (a
    compiler told to assume no NaN, as -ffast-math does, compiles the core's finiteness checks away), and a
    multiply and an add left unfused (a compiler that ignores -ffp-contract=off would change the bits every CPU
    is promised)."""
    from ctypes import c_float, c_uint32

    out = (c_uint32 * 4)()
    library.manas_philox((c_uint32 * 4)(0, 0, 0, 0), (c_uint32 * 2)(0, 0), out)
    if list(out) != [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]:
        return "Philox's known answer differs"
    values = (c_float * 4)(0.0, 1.0, float("nan"), float("inf"))
    if library.manas_first_not_finite(values, 4) != 2:
        return "a NaN went unseen; does $CC add -ffast-math?"
    if library.manas_first_not_finite(ctypes.byref(values, 4 * 3), 1) != 0:
        return "an infinity went unseen; does $CC add -ffast-math?"
    x = 1 + 2**-12  # x·x = 1 + 2^-11 + 2^-24: rounded, the 2^-24 is lost, and x·x − (1 + 2^-11) is 0; fused, 2^-24
    if library.manas_contraction_probe(x, x, -(1 + 2**-11)) != 0.0:
        return "it fuses a multiply and an add it was told not to; does $CC ignore -ffp-contract=off?"
    return None


def write_beside(target: Path, path: Path, text: str) -> None:
    """text as path's content, atomically (a temporary beside target that `locked` removes if a run dies first)."""
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".digest-{target.name}-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)
