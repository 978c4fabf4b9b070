"""The C core, compiled on first use with the system's compiler and loaded with ctypes.

Nothing is compiled at install time: `pip install` needs no compiler. The first run that wants the core compiles
core.c (`$CC`, else `cc`) into a per-user cache folder, `$XDG_CACHE_HOME/manas` else `~/.cache/manas`, under a
name keyed by a hash of the source, the flags, the compiler (its file and modification time) and the CPU's
features, so an upgrade of any of them builds afresh and two machines sharing a home folder never load each
other's code. A shared library
is code: one is loaded only from a folder the user owns and no one else can write, and only if the user owns it
and no one else can write it. A folder that fails those checks is refused with one notice, and the core is built
in a private temporary folder for this process instead.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("core.c")
# -ffp-contract=off: every multiply and add as written, so the core's order of arithmetic is its source's
# (core.c, "dots"); the lanes it writes out let the compiler vectorize without reassociating anything.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden")
LIBRARIES = ("-lm",)
ABI_VERSION = 2  # core.c's MANAS_ABI_VERSION: a library of another version is never used
COMPILE_TIMEOUT_S = 120


class NativeUnavailable(Exception):
    """The core cannot run here; `reason` says why in a few words, `detail` is the compiler's own message."""

    def __init__(self, reason: str, detail: str = "", notify: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail
        self.notify = notify  # say so even when the engine was not asked for by name (a library that failed its test)


@dataclass(frozen=True)
class Built:
    library: ctypes.CDLL
    path: Path
    compile_s: float | None  # seconds this process spent compiling it, None when it was cached
    notice: str | None  # a cache folder refused, and why


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "manas"


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
    for part in (SOURCE.read_bytes(), " ".join(FLAGS + LIBRARIES).encode(), compiler_identity(cc).encode(),
                 cpu_features().encode()):
        key.update(hashlib.sha256(part).digest())
    return f"core-{key.hexdigest()[:24]}.so"


def unsafe_reason(path: Path) -> str | None:
    """Why a folder or file must not be trusted with code: not ours, or writable by others."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid != os.getuid():
        return "is not owned by you"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "can be written by other users"
    return None


def private_folder(folder: Path) -> tuple[Path, str | None]:
    """folder, created for the user alone if missing, or a fresh temporary one when it cannot be trusted."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = unsafe_reason(folder)
    except OSError as exc:
        reason = f"cannot be created ({exc.strerror})"
    if reason is None:
        return folder, None
    return Path(tempfile.mkdtemp(prefix="manas-native-")), f"{folder} {reason}: the native core is built in a private temporary folder instead"


def compile_library(cc: str, target: Path) -> float:
    """Compile core.c into target atomically (a temporary name, then a rename); the seconds it took."""
    started = time.perf_counter()
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        try:
            result = subprocess.run([cc, *FLAGS, "-o", temporary, str(SOURCE), *LIBRARIES],
                                    capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"the C compiler {cc} failed", str(exc)) from None
        if result.returncode:
            raise NativeUnavailable(f"the C compiler {cc} failed on the native core", result.stderr)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return time.perf_counter() - started


def load(path: Path) -> ctypes.CDLL:
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeUnavailable("the native core does not load", str(exc)) from None
    if library.manas_abi_version() != ABI_VERSION:
        raise NativeUnavailable("the native core's library is of another version")
    return library


def build() -> Built:
    """The loaded core, compiled first if this source, compiler and CPU have no library in the cache yet, or the
    cached one does not load (truncated, corrupted): it is then rebuilt. Concurrent first runs take turns on a
    lock: one compiles, the others load what it built. A cache folder that cannot be written is replaced by a
    private temporary one, with a notice."""
    cc = compiler()
    name = library_name(cc)
    folder, notice = private_folder(cache_folder())
    try:
        return _build_in(cc, folder / name, notice)
    except OSError as exc:  # the folder is ours but not writable (a read-only home, a full disk)
        private = Path(tempfile.mkdtemp(prefix="manas-native-"))
        notice = f"{folder} cannot be written ({exc.strerror or exc}): the native core is built in a private " \
                 "temporary folder instead"
        return _build_in(cc, private / name, notice)


def _build_in(cc: str, target: Path, notice: str | None) -> Built:
    digest = target.with_name(f"{target.name}.sha256")
    with open(target.parent / f"{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if intact(target, digest):
            return Built(load(target), target, None, notice)
        compile_s = compile_library(cc, target)
        library = load(target)
        if failure := self_test(library):  # kept (its digest written) only once it has passed
            target.unlink()
            raise NativeUnavailable(f"the freshly built core failed its self-test ({failure}; does $CC add "
                                    "-ffast-math?), so it was deleted", notify=True)
        write_digest(target, digest)
    return Built(library, target, compile_s, notice)


def self_test(library: ctypes.CDLL) -> str | None:
    """What a newly built library gets wrong of a few known answers, or None: Philox4x32-10's first known-answer
    vector (Random123's; integer arithmetic the compiler must keep), and NaN and infinity found where they are (a
    compiler told to assume no NaN, as -ffast-math does, compiles the core's finiteness checks away)."""
    from ctypes import c_float, c_uint32

    out = (c_uint32 * 4)()
    library.manas_philox((c_uint32 * 4)(0, 0, 0, 0), (c_uint32 * 2)(0, 0), out)
    if list(out) != [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]:
        return "Philox's known answer differs"
    values = (c_float * 4)(0.0, 1.0, float("nan"), float("inf"))
    library.manas_first_not_finite.restype = ctypes.c_int64
    if library.manas_first_not_finite(values, ctypes.c_int64(4)) != 2:
        return "a NaN went unseen"
    if library.manas_first_not_finite(ctypes.byref(values, 4 * 3), ctypes.c_int64(1)) != 0:
        return "an infinity went unseen"
    return None


def intact(target: Path, digest: Path) -> bool:
    """Whether the cached library is the one compiled, byte for byte: loading a truncated or corrupted shared
    library kills the process (SIGBUS) before any error could be caught, so it is checked first, and rebuilt."""
    try:
        if unsafe_reason(target) or unsafe_reason(digest):
            return False
        return hashlib.sha256(target.read_bytes()).hexdigest() == digest.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False


def write_digest(target: Path, digest: Path) -> None:
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=".digest-")
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(hashlib.sha256(target.read_bytes()).hexdigest() + "\n")
    os.replace(temporary, digest)
