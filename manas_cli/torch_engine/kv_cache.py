"""A request-local key/value cache: prefill a prompt once, then decode one position at a time."""

from __future__ import annotations

import torch

from ..engine.session import allocation_description, decode_tokens, grown_size, prefill_rows
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
        size = grown_size(needed, self.length, self.capacity, self.reserve)
        batch, heads, _, head_size = k.shape
        k_buffer, v_buffer = k.new_empty(batch, heads, size, head_size), v.new_empty(batch, heads, size, head_size)
        if self.length:
            k_buffer[:, :, : self.length], v_buffer[:, :, : self.length] = self.k, self.v
        self._k_buffer, self._v_buffer = k_buffer, v_buffer


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
    def prefill(self, token_ids: torch.Tensor | list[list[int]]) -> torch.Tensor:
        """Reset the cache, run the prompt (B, T ≤ block_size) causally; logits of its last position (B, 1, vocab)."""
        self.reset()  # first: a refused prefill must not leave the previous request's cache to decode from
        token_ids = self._ids(token_ids, prefill_rows(token_ids, self.block_size))
        layers = [self._new_layer() for _ in self.model.blocks]
        logits = self._run(token_ids, 0, layers)  # an exception here leaves the session empty
        self.layers, self.batch_size = layers, token_ids.size(0)
        return logits

    def extend(self, token_ids: torch.Tensor | list[list[int]], keep: int) -> torch.Tensor:
        """NativeSession.extend's interface: here the whole prefill again (the model's multi-position attention
        assumes it starts at position 0), the same logits, only not incremental."""
        return self.prefill(token_ids)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Append one position per row ((B, 1) ids, or a list of B) and return its logits (B, 1, vocab)."""
        tokens = decode_tokens(token_ids, self.positions, self.batch_size, self.block_size)
        return self._run(self._ids(token_ids, [[token] for token in tokens]), self.positions, self.layers)

    def _ids(self, given: torch.Tensor | list, rows: list[list[int]]) -> torch.Tensor:
        """The ids as a tensor on the model's device: the one given, or one made of its checked rows."""
        if isinstance(given, torch.Tensor):
            return given
        return torch.tensor(rows, dtype=torch.long, device=self.model.token_embedding.weight.device)

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

    def layer_shapes(self) -> list[tuple[list[int], list[int], int]]:
        """Per layer: K's and V's shapes (B, n_kv_head, positions, head_size), and their bytes."""
        return [
            (
                list(layer.k.shape),
                list(layer.v.shape),
                layer.k.numel() * layer.k.element_size() + layer.v.numel() * layer.v.element_size(),
            )
            for layer in self.layers
        ]


def decode_torch_rows(model: GPT, tokens: list[int], sessions: list[CacheSession]) -> torch.Tensor:
    """One new token for each row of several sessions at once (engines.decode_sessions), each at its own
    position over its own cache; the logits (R, 1, vocab)."""
    ids = torch.tensor([[token] for token in tokens], dtype=torch.long, device=model.token_embedding.weight.device)
    return model.decode_rows(ids, [s.positions for s in sessions], [s.layers for s in sessions])


def check_cacheable(model: GPT) -> None:
    """Refuse a model whose modules do not match its config: the cache would silently compute something else."""
    config = model.config
    if model.training:
        raise ValueError("the model is in training mode: call model.eval() before caching")
    if config.position_encoding == "learned" and getattr(model, "position_embedding", None) is None:
        raise ValueError("learned position encoding but the model has no position_embedding table")
    qkv_width = config.attention_width + 2 * config.n_kv_head * config.head_size
    for i, block in enumerate(model.blocks):
        attention = block.attention
        expected_kind = RotaryAttention if config.uses_rope(i) else CausalSelfAttention
        if type(attention) is not expected_kind:
            raise ValueError(
                f"blocks[{i}].attention is {type(attention).__name__}, but position_encoding "
                f"{config.position_encoding!r} (nope_layers {config.nope_layers}) needs {expected_kind.__name__}"
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
