"""A GGUF model (llama.cpp's, ollama's, LM Studio's files) as a manas model: its hyperparameters as the Hugging
Face config of its architecture, its tensors dequantized to float32 by the gguf package (every type it reads:
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, IQ4_NL…) under their Hugging Face names, then the
import a Hugging Face folder of that architecture takes (llama.py, gpt2.py, starcoder2.py). llama.cpp's gpt2 and
starcoder2 are manas' GPT-2 block, learned or rotary positions. llama.cpp's `llama` rope rotates interleaved
pairs, so its queries and keys are permuted back to Hugging Face's rotate-half layout first; `qwen2`'s and
`starcoder2`'s already are. The tokenizer, its ends and the chat template come from the file's metadata
(gguf_vocab.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.config import GPTConfig
from ..errors import CheckpointError
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
    with_rope_factors,
)
from .gguf_metadata import read_layout
from .gguf_vocab import spec_from_fields, string_field
from .header import Checkpoint
from .huggingface import checked_template
from .importing import TIED_HEAD, build_model, make_config
from .tensor_files import GGUFTensors, Source
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
class GGUFImport:
    """A GGUF file read for import: its architecture (llama.cpp's name), the model's config, its tensors (read one
    at a time, dequantized to float32), the tokenizer and the chat template."""

    architecture: str
    config: GPTConfig
    tensors: GGUFTensors
    tokenizer_spec: dict
    chat_template: str | None

    def source(self) -> Source:
        """The file as convert and export read it, a layer at a time."""
        return Source(f"GGUF {self.architecture}", self.config, self.tensors, self.to_manas)

    def to_manas(
        self, tensors: dict[str, torch.Tensor], config: GPTConfig
    ) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
        """Some of the file's tensors (a layer's, or those outside the layers) under manas' names, and the config
        they belong to (a gpt2 file's repeated output layer may untie it)."""
        state = _hf_state(tensors, self.architecture, config, self.tensors.path)
        return _manas_state(state, self.architecture, config, self.tensors.path)


def read_gguf_import(path: Path) -> GGUFImport:
    """The file's config, tokenizer and chat template, and its tensors' extents checked; one CheckpointError (or
    TokenizerError) naming what it cannot read. No tensor is read but the few the config takes (rope factors)."""
    layout = read_layout(path)
    fields = layout.fields
    architecture = string_field(fields, "general.architecture", path, CheckpointError)
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: llama.cpp architecture {architecture!r} is not one manas imports from GGUF ({RUNS})"
        )
    tensors = GGUFTensors(path, layout)
    check_apart([(start, start + size, name) for name, (start, size) in tensors.extents.items()], path)
    check_block_count(layout, architecture, path)
    shapes = {name: tensors.shape(name) for name in tensors.names}
    short = (
        tensors.read(PHI3_SHORT_FACTORS).tolist() if architecture == "phi3" and PHI3_SHORT_FACTORS in shapes else None
    )
    config = huggingface.config_from_hf(hf_config(fields, architecture, shapes, path, short), path)
    if "rope_freqs.weight" in shapes:
        if architecture != "llama":
            raise CheckpointError(
                f"{path}: rope_freqs.weight in a {architecture} file, whose rope llama.cpp does not scale"
            )
        config = with_rope_factors(config, tensors.read("rope_freqs.weight").tolist(), path)
    if architecture in ("gpt2", "starcoder2"):  # Hugging Face's GPT-2 has no grouped-query attention; llama.cpp's has
        kv_heads = fields.get(f"{architecture}.attention.head_count_kv", config.n_head)
        config = make_config(path, **{**config.__dict__, "n_kv_head": kv_heads})  # checked, as every field is
    template = fields.get("tokenizer.chat_template")
    template = checked_template(template, path) if isinstance(template, str) and template.strip() else None
    return GGUFImport(architecture, config, tensors, spec_from_fields(fields, path), template)


def load_gguf_checkpoint(path: Path, device="cpu", dtype=None) -> Checkpoint:
    """A GGUF file as a torch model, its tensors dequantized to float32 in memory: for torch's engine and a GPU.
    The native core runs the file's blocks in place instead (gguf_weights.py)."""
    imported = read_gguf_import(path)
    tensors = {name: imported.tensors.read(name) for name in imported.tensors.names}
    model = build_model(*imported.to_manas(tensors, imported.config), path)
    model = model.to(device=device, dtype=dtype).eval()
    template = {"chat_template": imported.chat_template} if imported.chat_template else {}
    metadata = {"converted_from": f"GGUF {imported.architecture}"} | template
    return Checkpoint(model, build_encoding(imported.tokenizer_spec), imported.tokenizer_spec, path, metadata)


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
    for gguf_name, weights in tensors.items():
        if gguf_name not in by_gguf_name:
            if gguf_name in ("rope_freqs.weight", PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS):  # the config's
                continue
            raise CheckpointError(f"{path}: tensor {gguf_name} is not part of a {architecture} model manas runs")
        name = by_gguf_name[gguf_name]
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
    if head is not None:  # on the meta device (export planning its file), the config has been settled already
        embedding = renamed.get("token_embedding.weight", head)
        if not config.tie_embeddings or not (head.is_meta or torch.equal(head, embedding)):
            config, renamed = replace(config, tie_embeddings=False), renamed | {TIED_HEAD: head}
    return config, renamed
