"""How many CPU threads torch gets: exactly what the user asks for, or the cores no other process is using.

OpenMP's threads spin-wait for each other between products, so when another process holds one of two cores, each
product waits for a time slice: the shipped model decoded 221 tok/s on 2 threads against 727 on 1, with one
spinning process beside it (2-core AMD EPYC, torch 2.13; 853 against 745 on a quiet machine). A passive wait
policy held 0.94× of 1 thread under load, but cost 34% on a quiet machine. So manas counts the other processes'
running threads at start and gives torch the cores they leave, and re-checks during a generation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

THREADS_ENV = "MANAS_THREADS"
MAX_THREADS = 256  # OpenMP allocates each thread's stack up front: a million fails with libgomp's own message
RECHECK_S = 0.5  # how often a generation looks again at what else is running
SAMPLES = 3  # a transient process (a shell spawning) must be seen in every sample to count


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    rule: str  # what chose the count, as bench's header says it
    adaptive: bool  # chosen by manas: re-checked during a generation


def choose_threads(option: int | None) -> ThreadChoice:
    """--threads N exactly; else $MANAS_THREADS; else the cores that no other process's thread is running on."""
    if option is not None:
        return ThreadChoice(option, "--threads", adaptive=False)
    if value := os.environ.get(THREADS_ENV, "").strip():
        return ThreadChoice(threads_from_environment(value), f"${THREADS_ENV}", adaptive=False)
    cpus = usable_cpus()
    threads = free_cores(cpus)
    return ThreadChoice(threads, f"{threads} of {cpus} cores free at start", adaptive=True)


def threads_from_environment(value: str) -> int:
    from ..errors import InputError

    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if not 1 <= threads <= MAX_THREADS:
        raise InputError(
            f"${THREADS_ENV}={value!r} is not a thread count from 1 to {MAX_THREADS}: set it to one, or unset it"
        )
    return threads


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_cores(cpus: int) -> int:
    """The cores left by other processes' running threads, at least one."""
    others = min(_other_running_threads() for _ in range(SAMPLES))
    return max(1, cpus - others)


def _other_running_threads() -> int:
    """Threads running right now that are not ours: /proc/loadavg's count of runnable threads, less our own
    threads in the running state (OpenMP's workers, while they spin, and the thread reading)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: assume a quiet machine
    return max(0, running - _our_running_threads())


def _our_running_threads() -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as f:
                count += f.read().rpartition(")")[2].split()[0] == "R"
        except (OSError, IndexError):
            pass  # the thread ended meanwhile
    return count


class ThreadGovernor:
    """During a generation, gives the engine (torch, or the native core's pool) the cores free now, at most every
    RECHECK_S: a process that starts beside manas takes a core from it within half a second, and gives it back
    when it ends. A fixed choice stays fixed."""

    def __init__(self, choice: ThreadChoice, set_threads: Callable[[int], None]) -> None:
        """set_threads: how the engine takes a thread count (EngineChoice.set_threads)."""
        self.choice = choice
        self.set_threads = set_threads
        self.cpus = usable_cpus()
        self._checked_at = time.monotonic()

    def check(self) -> None:
        if not self.choice.adaptive or time.monotonic() - self._checked_at < RECHECK_S:
            return
        self._checked_at = time.monotonic()
        self.set_threads(free_cores(self.cpus))
