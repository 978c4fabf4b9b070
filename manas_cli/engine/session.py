"""What the KV caches of both engines share (kv_cache.CacheSession for torch, native.NativeSession for the core):
the allocation policies, the refusals of a prefill or decode that cannot be right, and the report of what a
cache holds. Free of torch."""

from __future__ import annotations

ALLOCATIONS = {
    "dynamic": "dynamic: written in place, doubled when full (at most half unused)",
    "static": "static: preallocated for the positions the run needs, written in place",
}


def grown_size(needed: int, held: int, capacity: int, reserve: bool) -> int:
    """The positions a cache holding `held` allocates when it needs `needed`: all of `capacity` at once when it
    reserves (static), else twice what it holds (or what it needs, if more), never past the capacity: growing
    copies the cache once per doubling, and at most half of what is allocated is unused."""
    return capacity if reserve else min(capacity, max(needed, 2 * held))


def allocation_description(allocation: str) -> str:
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    return ALLOCATIONS[allocation]


def prefill_rows(token_ids, block_size: int) -> list[list[int]]:
    """A prefill's rows of token ids, checked: lists as they are, a (B, T) LongTensor's as lists."""
    rows = token_ids
    if hasattr(token_ids, "tolist"):  # a tensor (this module never imports torch)
        if token_ids.dim() != 2 or str(token_ids.dtype) != "torch.int64":
            raise ValueError(
                f"prefill takes a non-empty (B, T) LongTensor, got {tuple(token_ids.shape)} {token_ids.dtype}"
            )
        rows = token_ids.tolist()
    check_prefill_rows(rows, block_size)
    return rows


def decode_tokens(token_ids, positions: int, batch_size: int, block_size: int) -> list[int]:
    """A decode step's token per row, checked: a list of B ids as it is, a (B, 1) tensor's as a list."""
    tokens = token_ids
    if hasattr(token_ids, "tolist"):
        if token_ids.dim() != 2 or token_ids.size(1) != 1:
            raise ValueError(f"decode takes ({batch_size}, 1) token ids, got {tuple(token_ids.shape)}")
        tokens = token_ids[:, 0].tolist()
    check_decode_rows(tokens, positions, batch_size, block_size)
    return tokens


def check_prefill_rows(rows: list[list[int]], block_size: int) -> None:
    """A prefill takes B ≥ 1 rows of the same T, 1 ≤ T ≤ block_size, token ids."""
    if not rows or not rows[0] or any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(
            f"prefill takes a non-empty (B, T) batch of token ids, got rows of {sorted({len(r) for r in rows})}"
        )
    if len(rows[0]) > block_size:
        raise ValueError(f"prefill of {len(rows[0])} positions exceeds block_size {block_size}")


def check_decode_rows(tokens: list[int], positions: int, batch_size: int, block_size: int) -> None:
    """A decode step takes one token per cached row, into a cache with room."""
    if not positions:
        raise ValueError("decode before prefill: prefill a prompt first")
    if len(tokens) != batch_size:
        raise ValueError(f"decode takes ({batch_size}, 1) token ids, got ({len(tokens)}, 1)")
    if positions >= block_size:
        raise ValueError(f"the cache is full ({block_size} positions): prefill the cropped window instead")


def prefill_if_due(session, windows: list[list[int]], first: bool, keep: int):
    """The window rule, in one place: prefills the prompt's window on the first step, and the last `keep` tokens
    of the window once the cache is full (all of it in recompute mode, half in shift mode), returning (kind,
    logits); otherwise runs nothing and returns None: the step decodes from the cache."""
    if first:
        return "prefill", session.prefill(windows)
    if session.positions >= session.block_size:
        return "re_prefill", session.prefill([window[-keep:] for window in windows])
    return None


def cache_report(session) -> dict:
    """What the cache holds, layer by layer, and what it would cost at a full window or without GQA; for a model
    with sliding windows (Gemma 3), each layer's window and the bytes of the positions it attends over (what a cache
    that kept only those would hold)."""
    storage = session.storage()
    config = session.model.config
    positions = storage["positions"]
    layers = []
    for index, (k_shape, v_shape, size) in enumerate(session.layer_shapes()):
        window = config.window(index)
        attended = size if window is None or positions <= window else size // positions * window
        layers.append({"layer": index, "k_shape": k_shape, "v_shape": v_shape, "bytes": size, "window": window,
                       "window_bytes": attended})  # fmt: skip
    bytes_per_position = storage["logical_bytes"] // positions if positions else 0
    return {
        **storage,
        "window_bytes": sum(layer["window_bytes"] for layer in layers),
        "block_size": config.block_size,
        "layers": layers,
        "bytes_per_position": bytes_per_position,
        "full_window_bytes": bytes_per_position * config.block_size,
        # A plain multi-head cache keeps every query head's K and V: n_head / n_kv_head times as much.
        "mha_equivalent_bytes": storage["logical_bytes"] * config.n_head // config.n_kv_head,
    }
