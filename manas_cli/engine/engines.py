"""Which engine runs a model, and the calls that work on either: the native core (native.py) or torch
(model.py, kv_cache.py, torch_sampling.py, imported only when torch runs)."""

from __future__ import annotations

from dataclasses import dataclass

from .native import NativeGPT, NativeSampling, NativeSession, decode_rows, native_unsupported, torch_weights_name
from .sampling import Sampler


def new_session(model, allocation: str = "dynamic", capacity: int | None = None):
    """The KV cache of one request, for whichever engine runs the model."""
    if isinstance(model, NativeGPT):
        return NativeSession(model, allocation, capacity)
    from .kv_cache import CacheSession

    return CacheSession(model, allocation, capacity)


def torch_generator(model, seed: int):
    """The torch engine's seeded torch.Generator on the model's device; None for the core, which keys its own
    generator on the seed (Sampler.seed)."""
    if isinstance(model, NativeGPT):
        return None
    import torch

    return torch.Generator(device=model.token_embedding.weight.device).manual_seed(seed)


def sampling_state(model, sampler: Sampler, rows: int, logprobs: int):
    """What sampling keeps for a request's rows between steps, for whichever engine runs the model."""
    if isinstance(model, NativeGPT):
        return NativeSampling(model, sampler, rows, logprobs)
    from .torch_sampling import TorchSampling

    return TorchSampling(model, sampler, rows, logprobs)


def last_logits(model, windows: list[list[int]]):
    """The full model's logits of each row's last position (the uncached reference), on either engine."""
    if isinstance(model, NativeGPT):
        return model.last_logits(windows)
    import torch

    with torch.inference_mode():
        return model(torch.tensor(windows, device=model.token_embedding.weight.device))[:, -1:]


def window_nats(model, window: list[int], targets: int, first_position: int = 0) -> float:
    """The summed negative log-likelihood of a window's last `targets` tokens, each given the tokens before it
    in the window, on either engine. first_position: the window's first token's position in the text (for the
    error when logits are not finite)."""
    if isinstance(model, NativeGPT):
        return model.window_nats(window, targets, first_position)
    from .torch_sampling import torch_window_nats

    return torch_window_nats(model, window, targets, first_position + len(window) - targets - 1)


def decode_sessions(model, tokens: list[int], sessions: list):
    """One decode step for the rows of several sessions at once (batching.py), on either engine."""
    if isinstance(model, NativeGPT):
        return decode_rows(model, tokens, sessions)
    from .kv_cache import decode_torch_rows

    return decode_torch_rows(model, tokens, sessions)


ENGINES = ("auto", "native", "torch")


@dataclass(frozen=True)
class EngineChoice:
    """What runs the model, and what the CLI should say about the choice."""

    model: object  # GPT or NativeGPT
    name: str  # "native" or "torch"
    weights: str = "float32"  # "float32", "bfloat16", "float16", "int8" or "int4"
    device: str = "cpu"
    notice: str | None = None  # native was asked for and cannot run, or its cache folder was refused
    detail: str = ""  # the compiler's or loader's own message, for --debug
    compile_s: float | None = None  # this run compiled the core
    library: str | None = None  # the core's shared library

    @property
    def threads(self) -> int:
        """The threads the engine computes on now."""
        if self.name == "native":
            return self.model.threads
        import torch

        return torch.get_num_threads()

    def set_threads(self, threads: int) -> None:
        if self.name == "native":
            self.model.set_threads(threads)
            return
        import torch

        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    @property
    def dtype(self) -> str:
        """What the activations compute in."""
        if self.name == "native":
            return "float32"
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def weights_bytes(self) -> int:
        if self.name == "native":
            return self.model.weights_bytes
        from .quantize import weights_bytes

        return weights_bytes(self.model)


def open_native(source, threads: int, on_compile=None) -> EngineChoice:
    """The core built (or loaded from its cache; on_compile() called before a compile starts) running `source` (a
    MappedCheckpoint or a torch GPT); raises native.build.NativeUnavailable when it cannot build or load here."""
    from ..native.build import build

    built = build(on_compile)
    model = NativeGPT(source, built.library, threads)
    return EngineChoice(model, "native", model.weights, "cpu", built.notice, compile_s=built.compile_s,
                        library=str(built.path))


def choose_engine(name: str, model, threads: int, unavailable=None, on_compile=None) -> EngineChoice:
    """For a torch model: `auto`, the native core when it can run the model and builds here, else torch;
    `native`, the same, with a notice when torch runs instead; `torch`, torch. `unavailable`: the reason the core
    already failed to build in this process (NativeUnavailable), not to try again."""
    from ..native.build import NativeUnavailable

    if name not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}")
    weights, device = torch_weights_name(model), str(model.token_embedding.weight.device)
    if name == "torch":
        return EngineChoice(model, "torch", weights, device)
    reason, detail = native_unsupported(model), ""
    if reason is None and unavailable is not None:
        reason, detail = unavailable.reason, unavailable.detail
    elif reason is None:
        try:
            return open_native(model, threads, on_compile)
        except NativeUnavailable as exc:
            unavailable, reason, detail = exc, exc.reason, exc.detail
    told = name == "native" or (unavailable is not None and unavailable.notify)
    notice = f"the native engine cannot run: {reason}; the torch engine runs instead" if told else None
    return EngineChoice(model, "torch", weights, device, notice, detail)
