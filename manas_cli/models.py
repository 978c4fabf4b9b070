"""Opening a model: a checkpoint path (or none: $MANAS_CHECKPOINT, else the shipped model) and the model flags in,
an engine out. The one call the CLI, the server and the benchmarks make; it is where the layers meet: formats
reads the file, the engine that runs it is chosen here and given its weights."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import store
from .engine.engines import ENGINES, Opened
from .errors import EngineUnavailable, InputError, ManasError

CHECKPOINT_ENV = "MANAS_CHECKPOINT"


@dataclass(frozen=True)
class ModelOptions:
    """The flags generate, bench, inspect-cache, score and serve share: which model, where, and how."""

    checkpoint: Path | None = None  # None: $MANAS_CHECKPOINT, else the shipped model
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    quantize: str | None = None  # "int8" or "int4"
    cache: str = "dynamic"  # the KV cache's allocation
    engine: str = "auto"  # "auto", "native" or "torch"
    float_activations: bool = False  # the core's int8 and int4 products in float32, not in integers
    ctx: int | None = None  # the window kept, at most the model's block_size; None: the model's
    debug: bool = False  # --debug: show the compiler's message when the native core does not build


@dataclass(frozen=True)
class LoadedModel:
    checkpoint: object  # formats.header.Checkpoint or formats.checkpoint.Checkpoint: the model, its tokenizer, path
    threads: object  # engine.threads.ThreadChoice: the count, and how it was chosen
    opened: Opened  # the engine, and what to say about how it was chosen
    window_notice: str | None = None  # --ctx over the model's window

    @property
    def engine(self):
        return self.opened.engine


def resolve_checkpoint(option: Path | None) -> Path:
    """-c/-m: a path, or a store name (`manas list`) where no such file is; else $MANAS_CHECKPOINT, else the
    shipped model."""
    if option is not None:
        return by_name(option)
    if os.environ.get(CHECKPOINT_ENV):
        return Path(os.environ[CHECKPOINT_ENV])
    candidates = store.shipped_candidates()
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise InputError(
        f"no checkpoint given and none found (looked at ${CHECKPOINT_ENV}, {looked}): pass --checkpoint PATH"
    )


def model_name(option: Path | None) -> str:
    """The model as the user named it (a store name, or the stem of the file given: a GGUF's own, not its
    conversion's in the cache), which the server's /v1/models lists."""
    return resolve_checkpoint(option).stem


def by_name(option: Path) -> Path:
    """A path as given, or the stored model its text names when no file of that name is here (a folder of that
    name does not hide the model)."""
    if (option.exists() and not option.is_dir()) or not store.is_name(str(option)):
        return option
    found = store.find(str(option))
    if found is None and option.is_dir():
        return option  # checkpoint_file says what the folder is
    if found is None and str(option).isdigit():  # llama.cpp's -c is the context size
        raise InputError(
            f"no model {str(option)!r}: -c and -m name the model in manas; the window in tokens is --ctx "
            f"{option} (llama.cpp's -c)"
        )
    if found is None:
        raise InputError(
            f"no model {str(option)!r}: no such file, and no such name in the store ({store.models_folder()}); "
            "`manas list` shows the names, `manas pull REPO` fetches a model from the Hugging Face Hub"
        )
    return found


def checkpoint_file(path: Path, on_step: Callable[[str], None] = lambda step: None) -> Path:
    """path, unless it is a folder or a pipe: say so (opening a FIFO would block, and a checkpoint is read by
    seeking)."""
    if path.is_dir() and (path / "config.json").is_file():
        raise InputError(
            f"checkpoint {path} is a Hugging Face folder: convert it first (manas convert {path} model.safetensors), "
            "or pull it from the Hub (manas pull OWNER/NAME)"
        )
    if path.is_dir():
        raise InputError(f"checkpoint {path} is a folder, not a file: pass the manas checkpoint (.safetensors) file")
    if path.exists() and not path.is_file():
        raise InputError(
            f"checkpoint {path} is not a regular file (a pipe or a device?): save it to a file and pass that"
        )
    return path


COMPILING = "compiling the native core (once per version of manas, compiler and CPU)"


def open_model(options: ModelOptions, on_step: Callable[[str], None] = lambda step: None) -> LoadedModel:
    """The checkpoint on the chosen device, dtype and thread count (and how that count was chosen), quantized if
    asked, and the engine that runs it: the native core, or torch with its float weights laid out for decoding.
    on_step(what) is called as each step that can take long begins (converting a GGUF file, loading, compiling the
    native core), for a display to show.

    On the CPU in float32 the core runs the mapped file itself and torch is never imported; torch loads only
    where it is needed: asked for, a GPU, a half-precision dtype, --quantize, or a core that does not build."""
    from .engine.threads import choose_threads
    from .native.build import NativeUnavailable

    threads = choose_threads(options.threads)
    path = _naming_the_environment(options, lambda: checkpoint_file(resolve_checkpoint(options.checkpoint), on_step))
    on_step(f"loading {resolve_checkpoint(options.checkpoint).name}")
    on_compile = partial(on_step, COMPILING)
    unavailable = None
    if is_gguf(path) and options.quantize is not None:
        raise InputError(
            f"{path.name} is a GGUF file: its quantized blocks already run as they are, so --quantize does not apply "
            "(run it without --quantize, or pick another quantization of the model)"
        )
    if not torch_needed(options):
        from .formats.gguf_weights import NotInPlace

        try:
            return _naming_the_environment(options, lambda: _load_native(options, path, threads, on_compile))
        except NotInPlace:
            pass  # torch reads it, and the core runs its float32 tensors
        except NativeUnavailable as exc:
            if options.engine == "native":  # asked for by name: never a silent change of engine
                raise EngineUnavailable(exc.reason, exc.detail) from None
            unavailable = exc  # torch runs it, without trying to build the core again
    return _load_with_torch(options, path, threads, unavailable, on_compile)


def open_draft(options: ModelOptions, draft: Path, encoding) -> LoadedModel:
    """A draft model for speculative decoding: run by the core (whose checks give each step's bits) at the model's
    threads, as it is stored, with the vocabulary of the model's `encoding`; every failure one InputError."""
    from dataclasses import replace

    from .formats.tokenizer import vocabulary_difference

    try:
        loaded = open_model(replace(options, checkpoint=draft, engine="native", quantize=None, ctx=None))
    except ManasError as exc:
        raise InputError(f"the draft model {draft}: {exc}") from None
    if (difference := vocabulary_difference(encoding, loaded.checkpoint.encoding)) is not None:
        raise InputError(
            f"the draft model {draft} has another vocabulary than the model's ({difference}): a draft must propose "
            "the model's own token ids (pick a model of the same family, or the model's own quantized copy)"
        )
    return loaded


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def _load_native(options: ModelOptions, path: Path, threads, on_compile) -> LoadedModel:
    """The mapped file run by the core: a manas checkpoint, or a GGUF file's blocks in place (formats/gguf_weights.py);
    raises native.build.NativeUnavailable where the core cannot build here."""
    from .formats.header import Checkpoint, open_checkpoint

    if is_gguf(path):
        from .formats.gguf_weights import GGUFWeights, open_gguf
        from .formats.tokenizer import build_encoding

        gguf = open_gguf(path)
        config, weights = gguf.config, partial(GGUFWeights, gguf)
        encoding, spec, metadata = build_encoding(gguf.tokenizer_spec), gguf.tokenizer_spec, gguf.metadata
    else:
        from .formats.mapped_weights import MappedWeights

        mapped = open_checkpoint(path)
        config, weights = mapped.header.config, partial(MappedWeights, mapped)
        encoding, spec, metadata = mapped.header.encoding, mapped.header.tokenizer_spec, mapped.header.metadata
    window = keep_window(config, options.ctx)
    opened = open_native(weights, threads.threads, on_compile, options.float_activations)
    checkpoint = Checkpoint(opened.engine.model, encoding, spec, path, metadata)
    return LoadedModel(checkpoint, threads, opened, window)


def _load_with_torch(options: ModelOptions, path: Path, threads, unavailable, on_compile) -> LoadedModel:
    import torch

    from .formats.checkpoint import load_checkpoint
    from .formats.gguf_model import load_gguf_checkpoint
    from .torch_engine.runtime import resolve_device, resolve_dtype

    torch.set_num_threads(threads.threads)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    load = load_gguf_checkpoint if is_gguf(path) else load_checkpoint
    checkpoint = _naming_the_environment(options, lambda: load(path, device=device, dtype=dtype))
    if options.quantize is not None:
        quantize_checkpoint(checkpoint, options.quantize, "run it without --quantize")
    window = keep_window(checkpoint.model.config, options.ctx)
    opened = choose_engine(
        options.engine, checkpoint.model, threads.threads, unavailable, on_compile, options.float_activations
    )
    opened.engine.beside_torch(torch)
    return LoadedModel(checkpoint, threads, opened, window)


def keep_window(config, ctx: int | None) -> str | None:
    """--ctx: the window kept is ctx tokens, at most the model's own. Everything that crops, caches and re-prefills
    reads block_size, so a smaller one is the whole change; the tensors (a learned position table) keep their rows.
    A notice when ctx is over the model's window (which is then what it keeps)."""
    if ctx is None:
        return None
    if ctx > config.block_size:
        return f"notice: --ctx {ctx:,} is over the model's window: it keeps its {config.block_size:,} tokens"
    config.block_size = ctx
    return None


def open_native(
    weights: Callable, threads: int, on_compile: Callable[[], None] | None = None, float_activations: bool = False
) -> Opened:
    """The core built (or loaded from its cache; on_compile() called before a compile starts) running the model
    whose tensors weights(library) points it at (formats/mapped_weights.py, torch_engine/native_weights.py), its
    int8 and int4 products in integers unless float_activations; raises native.build.NativeUnavailable when it cannot
    build or load here."""
    from .native.build import build
    from .native.engine import NativeEngine
    from .native.model import NativeGPT

    built = build(on_compile)
    engine = NativeEngine(NativeGPT(weights(built.library), built.library, threads, float_activations))
    return Opened(engine, built.notice, compile_s=built.compile_s, library=str(built.path))


def choose_engine(
    name: str, model, threads: int, unavailable=None, on_compile=None, float_activations: bool = False
) -> Opened:
    """For a torch model: `auto`, the native core when it can run the model and builds here, else torch;
    `native`, the core or EngineUnavailable naming why it cannot run; `torch`, torch. `unavailable`: the reason the core
    already failed to build in this process (NativeUnavailable), not to try again."""
    from .native.build import NativeUnavailable
    from .torch_engine.engine import TorchEngine
    from .torch_engine.native_weights import TorchWeights, native_unsupported

    if name not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}")
    if name == "torch":
        return Opened(TorchEngine(model))
    reason, detail = native_unsupported(model), ""
    if reason is None and unavailable is not None:
        reason, detail = unavailable.reason, unavailable.detail
    elif reason is None:
        try:
            return open_native(lambda library: TorchWeights(model), threads, on_compile, float_activations)
        except NativeUnavailable as exc:
            unavailable, reason, detail = exc, exc.reason, exc.detail
    if name == "native":  # asked for by name: never a silent change of engine
        raise EngineUnavailable(reason, detail)
    told = unavailable is not None and unavailable.notify
    notice = f"the native engine cannot run: {reason}; the torch engine runs instead" if told else None
    return Opened(TorchEngine(model), notice, detail)


def torch_needed(options: ModelOptions) -> bool:
    """Whether the run needs torch before its model loads: the torch engine asked for, a GPU (or a machine that
    may have one: CUDA's or ROCm's device files), a half-precision dtype, or --quantize."""
    gpu = options.device not in ("auto", "cpu") or (
        options.device == "auto"
        and any(os.path.exists(device) for device in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg"))
    )
    return options.engine == "torch" or gpu or options.dtype not in ("auto", "float32") or options.quantize is not None


def _naming_the_environment(options: ModelOptions, load):
    """load(), whose error says where the path came from when it is $MANAS_CHECKPOINT's."""
    try:
        return load()
    except ManasError as exc:
        if options.checkpoint is None and os.environ.get(CHECKPOINT_ENV):  # the user may not remember setting it
            raise type(exc)(
                f"{exc} (the path comes from ${CHECKPOINT_ENV}: fix it, unset it, or pass --checkpoint)"
            ) from None
        raise


def quantize_checkpoint(checkpoint, kind: str, hint: str) -> None:
    """Quantize a loaded float checkpoint's model to int8 or int4, refusing one that is quantized already, or whose
    width int4's groups do not divide."""
    from .torch_engine.quantize import quantization, quantize_checked, quantized_tensor_names

    if stored := quantized_tensor_names(checkpoint.model):
        raise InputError(
            f"{checkpoint.path} is already quantized: its tensor {stored[0]} is "
            f"{quantization(checkpoint.model)} ({hint})"
        )
    quantize_checked(checkpoint.model, kind, checkpoint.path)
