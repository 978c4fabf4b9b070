"""A GGUF model (llama.cpp's, ollama's, LM Studio's files) as a manas model: its hyperparameters as the Hugging
Face config of its architecture, its tensors dequantized to float32 by the gguf package (every type it reads:
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, IQ4_NL…) under their Hugging Face names, then the
import a Hugging Face folder of that architecture takes (llama.py, gpt2.py, starcoder2.py). llama.cpp's gpt2 and
starcoder2 are manas' GPT-2 block, learned or rotary positions. llama.cpp's `llama` rope rotates interleaved
pairs, so its queries and keys are permuted back to Hugging Face's rotate-half layout first; `qwen2`'s and
`starcoder2`'s already are. The tokenizer, its ends and the chat template come from the file's metadata
(gguf_vocab.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.config import GPTConfig
from ..errors import CheckpointError, first_line
from ..torch_engine.model import GPT
from . import gemma, gpt2, huggingface, llama, phi3, rotary_layout, starcoder2
from .gguf_config import (
    ARCHITECTURES,
    INTERLEAVED,
    LLAMA_FAMILY,
    PHI3_LONG_FACTORS,
    PHI3_SHORT_FACTORS,
    RUNS,
    check_apart,
    check_block_count,
    hf_config,
    tensor_extent,
    with_rope_factors,
)
from .gguf_metadata import Layout, read_layout
from .gguf_vocab import read_gguf, spec_from_fields, string_field
from .header import Checkpoint
from .huggingface import checked_template
from .importing import TIED_HEAD, build_model, make_config
from .tokenizer import build_encoding

LLAMA_LAYER_MODULES = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# Per architecture: its Hugging Face twin's tensors outside the layers, the layers' prefix and modules.
HF_LAYOUTS = {
    "llama": (("model.embed_tokens.weight", "model.norm.weight", TIED_HEAD), "model.layers", LLAMA_LAYER_MODULES),
    "gpt2": (
        ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias",
         TIED_HEAD),
        "transformer.h",
        tuple(gpt2.GPT2_BLOCK_MODULES),
    ),
    "starcoder2": (
        ("model.embed_tokens.weight", "model.norm.weight", "model.norm.bias", TIED_HEAD),
        "model.layers",
        ("input_layernorm", *rotary_layout.QKV_MODULES, *starcoder2.BLOCK_MODULES.values()),
    ),
}  # fmt: skip
HF_LAYOUTS["qwen2"] = HF_LAYOUTS["smollm3"] = HF_LAYOUTS["llama"]
HF_LAYOUTS["phi3"] = (
    HF_LAYOUTS["llama"][0],
    "model.layers",
    ("input_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj",
     "mlp.down_proj"),
)  # fmt: skip
HF_LAYOUTS["gemma3"] = (
    HF_LAYOUTS["llama"][0],
    "model.layers",
    (*rotary_layout.QKV_MODULES, *gemma.BLOCK_MODULES.values()),
)
HF_LAYOUTS["qwen3"] = (
    HF_LAYOUTS["llama"][0],
    "model.layers",
    (*LLAMA_LAYER_MODULES, "self_attn.q_norm", "self_attn.k_norm"),
)


@dataclass
class GGUFModel:
    architecture: str  # llama.cpp's name
    model: GPT
    tokenizer_spec: dict
    chat_template: str | None


def load_gguf(path: Path) -> GGUFModel:
    """The model, tokenizer and chat template of a GGUF file; one CheckpointError (or TokenizerError) naming what
    it cannot read."""
    layout = read_layout(path)
    fields = layout.fields
    architecture = string_field(fields, "general.architecture", path, CheckpointError)
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: llama.cpp architecture {architecture!r} is not one manas imports from GGUF ({RUNS})"
        )
    check_layout(layout, path)
    check_block_count(layout, architecture, path)
    names = {tensor.name: tensor for tensor in read_gguf(path).tensors}  # the package reads the tensors
    shapes = {name: _shape(tensor) for name, tensor in names.items()}
    import gguf

    short = names.get(PHI3_SHORT_FACTORS) if architecture == "phi3" else None
    short = None if short is None else _dequantized(gguf, short, path).tolist()
    config = huggingface.config_from_hf(hf_config(fields, architecture, shapes, path, short), path)
    if "rope_freqs.weight" in names:
        if architecture != "llama":
            raise CheckpointError(
                f"{path}: rope_freqs.weight in a {architecture} file, whose rope llama.cpp does not scale"
            )
        config = with_rope_factors(config, _dequantized(gguf, names["rope_freqs.weight"], path).tolist(), path)
    if architecture in ("gpt2", "starcoder2"):  # Hugging Face's GPT-2 has no grouped-query attention; llama.cpp's has
        kv_heads = fields.get(f"{architecture}.attention.head_count_kv", config.n_head)
        config = make_config(path, **{**config.__dict__, "n_kv_head": kv_heads})  # checked, as every field is
    state = _hf_state(names, architecture, config, path)
    model = build_model(*_manas_state(state, architecture, config, path), path)
    template = fields.get("tokenizer.chat_template")
    template = checked_template(template, path) if isinstance(template, str) and template.strip() else None
    return GGUFModel(architecture, model, spec_from_fields(fields, path), template)


def load_gguf_checkpoint(path: Path, device="cpu", dtype=None) -> Checkpoint:
    """A GGUF file as a torch model, its tensors dequantized to float32 in memory: for torch's engine, a GPU and
    export. The native core runs the file's blocks in place instead (gguf_weights.py)."""
    imported = load_gguf(path)
    model = imported.model.to(device=device, dtype=dtype).eval()
    template = {"chat_template": imported.chat_template} if imported.chat_template else {}
    metadata = {"converted_from": f"GGUF {imported.architecture}"} | template
    return Checkpoint(model, build_encoding(imported.tokenizer_spec), imported.tokenizer_spec, path, metadata)


def check_layout(layout: Layout, path: Path) -> None:
    """Every tensor's extent inside the file's data section, aligned and apart from the others, its block count
    whole for its shape, before anything reads it (the gguf package would add a wrapping offset, and read the
    header as weights)."""
    import gguf

    extents = []
    for tensor in layout.tensors:
        if tensor.kind not in gguf.GGML_QUANT_SIZES:
            raise CheckpointError(f"{path}: tensor {tensor.name} has an unknown ggml type {tensor.kind}")
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.kind)]
        start, size = tensor_extent(tensor, layout, block, path)
        extents.append((start, start + size, tensor.name))
    check_apart(extents, path)


def _hf_state(tensors: dict, architecture: str, config: GPTConfig, path: Path) -> dict[str, torch.Tensor]:
    """The tensors under their Hugging Face names, float32, in PyTorch's (out, in) layout (GPT-2's too: llama.cpp
    stores no Conv1D); every tensor of the file must be one of the model's."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], config.n_layer)
    top, prefix, modules = HF_LAYOUTS[architecture]
    hf_names = [*top, *(f"{prefix}.{i}.{m}.{kind}" for i in range(config.n_layer) for m in modules
                        for kind in ("weight", "bias"))]  # fmt: skip
    by_gguf_name = {names.get_name(name, try_suffixes=(".weight", ".bias")): name for name in hf_names}
    state = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name not in by_gguf_name:
            if gguf_name in ("rope_freqs.weight", PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS):  # the config's (load_gguf)
                continue
            raise CheckpointError(f"{path}: tensor {gguf_name} is not part of a {architecture} model manas runs")
        name = by_gguf_name[gguf_name]
        weights = torch.from_numpy(_dequantized(gguf, tensor, path))
        if architecture in INTERLEAVED and name.endswith(rotary_layout.QUERY_KEY_TENSORS):
            heads = config.n_head if ".q_proj." in name else config.n_kv_head
            weights = rotary_layout.to_rotate_half(weights, heads, config.rotary_dims)  # interleaved → Hugging Face's
        if architecture == "gemma3" and name.endswith("norm.weight"):
            weights = weights - 1  # llama.cpp's converter stored the 1 + w Gemma's norms scale by
        state[name] = weights
    return state


def _manas_state(
    state: dict[str, torch.Tensor], architecture: str, config: GPTConfig, path: Path
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config and tensors of the manas model. GPT-2's and StarCoder2's llama.cpp files may repeat the tied
    output layer (quantized on its own, so not always equal to the embedding): equal, it is dropped; else the
    model keeps an output layer of its own."""
    if architecture in LLAMA_FAMILY:
        return config, llama.state_to_manas(state, config, path)
    if architecture == "gemma3":
        return config, gemma.state_to_manas(state, config, path)
    if architecture == "phi3":
        return config, phi3.state_to_manas(state, config, path)
    head = state.pop(TIED_HEAD, None)
    if architecture == "gpt2":
        renamed = gpt2.gpt2_state_to_manas(state, conv1d=False, source=path)
    else:
        renamed = starcoder2.state_to_manas(state, config, path)
    if head is not None and not torch.equal(head, renamed.get("token_embedding.weight", head)):
        config, renamed = replace(config, tie_embeddings=False), renamed | {TIED_HEAD: head}
    return config, renamed


def _dequantized(gguf, tensor, path: Path):
    """A tensor's values as float32, as the gguf package dequantizes them, in the shape the file gives it; each one
    finite (a scale of NaN or infinity is refused here, naming the file and the tensor). The package's numpy
    warnings about such values stay off the user's terminal: the error says it."""
    import numpy as np

    kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            values = values.astype("float32").reshape(tuple(int(n) for n in reversed(tensor.shape))).copy()
    except Exception as exc:  # a type the package cannot dequantize, a size that does not match its shape
        raise CheckpointError(f"{path}: tensor {tensor.name} ({kind}) cannot be read: {first_line(exc)}") from None
    if not np.isfinite(values).all():
        raise CheckpointError(
            f"{path}: tensor {tensor.name} ({kind}) holds a value that is not finite (NaN or infinity): the file is "
            "damaged"
        )
    return values


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))
