"""A request-local key/value cache: prefill a prompt once, then decode one position at a time."""

from __future__ import annotations

import torch

from .model import GPT, CausalSelfAttention, RotaryAttention


class LayerCache:
    """One layer's keys and values, (B, n_kv_head, positions, head_size), written in place into buffers.

    A decode step writes its one position; it never copies the positions already cached (a concatenation would,
    at every step, in time that grows with the context). The buffers start at the positions first written and,
    when full, grow to twice that, up to `capacity`: growing copies the cache once per doubling, and at most half
    of what is allocated is unused. `reserve` allocates `capacity` at once (the static cache). `k` and `v` are
    views of the filled positions; the cached tensors never share storage with the qkv projection they came from.
    """

    def __init__(self, capacity: int, reserve: bool = False) -> None:
        self.capacity = capacity
        self.reserve = reserve
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._k_buffer: torch.Tensor | None = None
        self._v_buffer: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {end} were asked for")
        if self._k_buffer is None or end > self._k_buffer.size(2):
            self._grow(k, v, end)
        self._k_buffer[:, :, self.length : end] = k
        self._v_buffer[:, :, self.length : end] = v
        self.length = end
        self.k, self.v = self._k_buffer[:, :, :end], self._v_buffer[:, :, :end]
        return self.k, self.v

    def _grow(self, k: torch.Tensor, v: torch.Tensor, needed: int) -> None:
        size = self.capacity if self.reserve else min(self.capacity, max(needed, 2 * self.length))
        batch, heads, _, head_size = k.shape
        k_buffer, v_buffer = k.new_empty(batch, heads, size, head_size), v.new_empty(batch, heads, size, head_size)
        if self.length:
            k_buffer[:, :, : self.length], v_buffer[:, :, : self.length] = self.k, self.v
        self._k_buffer, self._v_buffer = k_buffer, v_buffer


ALLOCATIONS = {
    "dynamic": "dynamic: written in place, doubled when full (at most half unused)",
    "static": "static: preallocated for the positions the run needs, written in place",
}


def allocation_description(allocation: str) -> str:
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    return ALLOCATIONS[allocation]


class CacheSession:
    """The KV cache of one request against a model in eval mode.

    allocation "dynamic" (the default) holds exactly the cached positions; "static" preallocates `capacity`
    positions (default, and at most, the window): what the run will use, not what the file claims it could.
    """

    def __init__(self, model: GPT, allocation: str = "dynamic", capacity: int | None = None) -> None:
        self.allocation = allocation_description(allocation)
        check_cacheable(model)
        self.model = model
        self.block_size = model.config.block_size
        capacity = self.block_size if capacity is None else min(capacity, self.block_size)
        self._new_layer = lambda: LayerCache(capacity, reserve=allocation == "static")
        self.layers: list[LayerCache] = []
        self.batch_size = 0

    @property
    def positions(self) -> int:
        return 0 if not self.layers or self.layers[0].k is None else self.layers[0].k.size(2)

    def reset(self) -> None:
        self.layers = []
        self.batch_size = 0

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reset the cache, run the prompt (B, T ≤ block_size) causally; logits of its last position (B, 1, vocab)."""
        self.reset()  # first: a refused prefill must not leave the previous request's cache to decode from
        check_prefill_ids(token_ids, self.block_size)
        layers = [self._new_layer() for _ in self.model.blocks]
        logits = self._run(token_ids, 0, layers)  # an exception here leaves the session empty
        self.layers, self.batch_size = layers, token_ids.size(0)
        return logits

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append one position per row (B, 1) and return its logits (B, 1, vocab)."""
        check_decode_ids(token_ids, self.positions, self.batch_size, self.block_size)
        return self._run(token_ids, self.positions, self.layers)

    def _run(self, token_ids: torch.Tensor, start_pos: int, layers: list) -> torch.Tensor:
        hidden = self.model.hidden_states(token_ids, start_pos, layers)
        return self.model.lm_head(hidden[:, -1:])

    def storage(self) -> dict:
        """Logical bytes (what K and V hold) against the bytes their storages really allocate."""
        tensors = [t for layer in self.layers for t in (layer.k, layer.v) if t is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return {
            "positions": self.positions,
            "logical_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "storage_bytes": sum(storages.values()),
            "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
            "allocation": self.allocation,
        }


def check_prefill_ids(token_ids: torch.Tensor, block_size: int) -> None:
    if token_ids.dim() != 2 or token_ids.size(1) == 0 or token_ids.dtype != torch.long:
        raise ValueError(f"prefill takes a non-empty (B, T) LongTensor, got {tuple(token_ids.shape)} {token_ids.dtype}")
    if token_ids.size(1) > block_size:
        raise ValueError(f"prefill of {token_ids.size(1)} positions exceeds block_size {block_size}")


def check_decode_ids(token_ids: torch.Tensor, positions: int, batch_size: int, block_size: int) -> None:
    if not positions:
        raise ValueError("decode before prefill: prefill a prompt first")
    if tuple(token_ids.shape) != (batch_size, 1):
        raise ValueError(f"decode takes ({batch_size}, 1) token ids, got {tuple(token_ids.shape)}")
    if positions >= block_size:
        raise ValueError(f"the cache is full ({block_size} positions): prefill the cropped window instead")


def check_cacheable(model: GPT) -> None:
    """Refuse a model whose modules do not match its config: the cache would silently compute something else."""
    config = model.config
    if model.training:
        raise ValueError("the model is in training mode: call model.eval() before caching")
    if config.position_encoding == "learned" and getattr(model, "position_embedding", None) is None:
        raise ValueError("learned position encoding but the model has no position_embedding table")
    expected_kind = RotaryAttention if config.position_encoding == "rope" else CausalSelfAttention
    qkv_width = config.n_embd + 2 * config.n_kv_head * config.head_size
    for i, block in enumerate(model.blocks):
        attention = block.attention
        if type(attention) is not expected_kind:
            raise ValueError(
                f"blocks[{i}].attention is {type(attention).__name__}, "
                f"but position_encoding {config.position_encoding!r} needs {expected_kind.__name__}"
            )
        if (attention.n_head, attention.n_kv_head) != (config.n_head, config.n_kv_head):
            raise ValueError(
                f"blocks[{i}].attention has n_head={attention.n_head}, n_kv_head={attention.n_kv_head}; "
                f"the config says n_head={config.n_head}, n_kv_head={config.n_kv_head}"
            )
        if (attention.qkv.out_features, attention.qkv.in_features) != (qkv_width, config.n_embd):
            raise ValueError(
                f"blocks[{i}].attention.qkv maps {attention.qkv.in_features} to {attention.qkv.out_features} "
                f"features, expected {config.n_embd} to {qkv_width}"
            )


def cache_report(session: CacheSession) -> dict:
    """What the cache holds, layer by layer, and what it would cost at a full window or without GQA."""
    storage = session.storage()
    config = session.model.config
    layers = [
        {
            "layer": index,
            "k_shape": list(layer.k.shape),
            "v_shape": list(layer.v.shape),
            "bytes": layer.k.numel() * layer.k.element_size() + layer.v.numel() * layer.v.element_size(),
        }
        for index, layer in enumerate(session.layers)
    ]
    bytes_per_position = storage["logical_bytes"] // storage["positions"] if storage["positions"] else 0
    return {
        **storage,
        "block_size": config.block_size,
        "layers": layers,
        "bytes_per_position": bytes_per_position,
        "full_window_bytes": bytes_per_position * config.block_size,
        # A plain multi-head cache keeps every query head's K and V: n_head / n_kv_head times as much.
        "mha_equivalent_bytes": storage["logical_bytes"] * config.n_head // config.n_kv_head,
    }
