"""What a run needs in memory, checked against what the machine has before the run allocates it."""

from __future__ import annotations

import resource

from ..errors import InputError
from .config import GPTConfig


def run_bytes(config: GPTConfig, rows: int, positions: int, itemsize: int) -> int:
    """About what `rows` sequences of `positions` cost beside the weights: their KV cache, and the activations of
    a prefill over all of them (q|k|v, the feed-forward's width (twice, gated), the residual stream, and attention
    scores in case the kernel materializes them), plus float32 logits."""
    kv_width = config.n_kv_head * config.head_size
    cache = 2 * config.n_layer * kv_width * positions
    widths = config.attention_width + 2 * kv_width + 2 * config.ffn_width + 2 * config.n_embd
    activations = (widths + config.n_head * positions) * positions
    return rows * ((cache + activations) * itemsize + 2 * config.vocab_size * 4)


def cpu_available_bytes() -> int | None:
    """Free memory on the CPU: the smaller of MemAvailable and what the process's address-space limit (ulimit -v)
    leaves; None when neither can be read."""
    limits = [_meminfo_bytes("/proc/meminfo", "MemAvailable")]
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        used = _meminfo_bytes("/proc/self/status", "VmSize")
        limits.append(address_space - used if used is not None else None)
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def process_peak_bytes() -> int:
    """The whole process's peak resident memory (Linux reports it in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_fits(engine, rows: int, positions: int, lower: str) -> None:
    """Refuse, before allocating, a run that needs more memory than the engine's device has (Engine's
    free_memory_bytes); `lower` names what to lower."""
    needed = run_bytes(engine.config, rows, positions, engine.activation_bytes)
    available = engine.free_memory_bytes()
    if available is not None and needed > available:
        raise InputError(
            f"this run needs about {_gib(needed)} ({rows:,} × {positions:,} positions of KV cache and activations) "
            f"but {_gib(available)} is free: lower {lower}"
            + (
                f", or keep a shorter window with --ctx (the model's is {positions:,})"
                if positions == engine.config.block_size
                else ""
            )
        )


def fitting_rows(engine, rows: int, positions: int) -> int:
    """The most rows, up to `rows`, of `positions` each that the engine's device has free memory for; at least 1
    (check_fits then says why one does not fit)."""
    available = engine.free_memory_bytes()
    if available is None:
        return rows
    return max(1, min(rows, available // run_bytes(engine.config, 1, positions, engine.activation_bytes)))


def fitting_window(engine, rows: int, smallest: int = 512) -> int | None:
    """The model's window, or where `rows` of it need more memory than the engine's device has free, the largest
    halving of it (down to `smallest`) that fits; None when the window fits, or nothing does."""
    available = engine.free_memory_bytes()
    window = engine.config.block_size

    def fits(positions: int) -> bool:
        return run_bytes(engine.config, rows, positions, engine.activation_bytes) <= available

    if available is None or fits(window):
        return None
    while window > smallest:
        window = max(smallest, window // 2)
        if fits(window):
            return window
    return None


def _meminfo_bytes(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(count: int) -> str:
    return f"{count / 2**30:,.1f} GiB" if count >= 2**30 else f"{count / 2**20:,.1f} MiB"
