"""The torch engine (engine/engines.py's Engine): the torch GPT (model.py) with its KV cache (kv_cache.py) and
sampling (sampling.py), on any device and dtype torch runs."""

from __future__ import annotations

import torch

from ..engine.memory import cpu_available_bytes, process_peak_bytes
from ..engine.sampling import Sampler
from .kv_cache import CacheSession, decode_torch_rows
from .model import GPT, use_decode_layout
from .quantize import is_quantized, weights_bytes, weights_name
from .sampling import TorchSampling, torch_window_nats


class TorchEngine:
    name = "torch"
    arithmetic_version = None  # torch's kernels differ by CPU and build: no version to promise

    def __init__(self, model: GPT) -> None:
        self.model, self.config = model, model.config
        self.weights = weights_name(model)
        embedding = model.token_embedding.weight
        self.device = str(embedding.device)
        self.dtype = str(embedding.dtype).removeprefix("torch.")  # what the activations compute in
        self.activation_bytes = embedding.element_size()
        self._device = embedding.device

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    def set_threads(self, threads: int) -> None:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def beside_torch(self, torch_module) -> None:
        """Float weights transposed in memory for decoding's matrix-vector products; quantized layers keep their own
        layout, and the embeddings gain nothing."""
        if not is_quantized(self.model):
            use_decode_layout(self.model)

    @property
    def weights_bytes(self) -> int:
        return weights_bytes(self.model)

    def new_session(self, allocation: str = "dynamic", capacity: int | None = None) -> CacheSession:
        return CacheSession(self.model, allocation, capacity)

    def sampling_state(self, sampler: Sampler, rows: int, logprobs: int) -> TorchSampling:
        return TorchSampling(self.model, sampler, rows, logprobs)

    def generator(self, seed: int) -> torch.Generator:
        """The seeded generator the sampler draws with, on the model's device."""
        return torch.Generator(device=self._device).manual_seed(seed)

    def decode_rows(self, tokens: list[int], sessions: list[CacheSession]) -> torch.Tensor:
        return decode_torch_rows(self.model, tokens, sessions)

    @torch.inference_mode()
    def last_logits(self, windows: list[list[int]]) -> torch.Tensor:
        """The full model's logits of each row's last position (the uncached reference), (B, 1, vocab)."""
        return self.model(torch.tensor(windows, device=self._device))[:, -1:]

    def window_nats(self, window: list[int], targets: int, first_position: int = 0) -> float:
        return torch_window_nats(self.model, window, targets, first_position + len(window) - targets - 1)

    def free_memory_bytes(self) -> int | None:
        if self._device.type == "cuda":
            return torch.cuda.mem_get_info(self._device)[0]
        return cpu_available_bytes()

    def peak_memory_bytes(self) -> int:
        """Peak GPU memory allocated on CUDA; the whole process's peak resident memory on the CPU."""
        if self._device.type == "cuda":
            return torch.cuda.max_memory_allocated(self._device)
        return process_peak_bytes()
