"""GPT-2, both ways: its tensor names (nanoGPT kept them too), its Hugging Face config and weights. nanoGPT's
nn.Linear stores weights out×in as manas does, Hugging Face's Conv1D in×out; the prefixes differ
(torch.compile's `_orig_mod.`, GPT2LMHeadModel's `transformer.`), and so does the GELU each was trained with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig
from ..errors import CheckpointError
from .header import TIED
from .importing import TIED_HEAD, check_tied_head, make_config, typed_field, with_zero_biases

if TYPE_CHECKING:
    import torch


MODEL_TYPE = "gpt2"
# Inside transformer.h.N: GPT-2's module names (nanoGPT's too) and manas' inside blocks.N.
GPT2_BLOCK_MODULES = {
    "ln_1": "ln_attention",
    "attn.c_attn": "attention.qkv",  # fused q|k|v in both, in that order
    "attn.c_proj": "attention.output",
    "ln_2": "ln_ffn",
    "mlp.c_fc": "ffn.up",
    "mlp.c_proj": "ffn.down",
}
GPT2_TOP_MODULES = {"wte": "token_embedding", "wpe": "position_embedding", "ln_f": "final_norm"}
GPT2_LINEAR_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# Causal masks that older nanoGPT (no flash attention) and older transformers saved as buffers: not weights.
GPT2_MASK_BUFFERS = ("attn.bias", "attn.masked_bias")

# Hugging Face's activation_function values that manas computes exactly, as F.gelu's `approximate`.
HF_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
GELU_TO_HF = {"tanh": "gelu_new", "none": "gelu"}


# --- tensor names -----------------------------------------------------------------------------------------------


def manas_name(gpt2_name: str) -> str | None:
    """GPT-2's name (without prefixes) of a tensor → manas' name; None for mask buffers; KeyError if unknown."""
    if gpt2_name.startswith("h."):
        _, index, rest = gpt2_name.split(".", 2)
        if rest in GPT2_MASK_BUFFERS:
            return None
        module, _, kind = rest.rpartition(".")
        return f"blocks.{index}.{GPT2_BLOCK_MODULES[module]}.{kind}"
    module, _, kind = gpt2_name.rpartition(".")
    return f"{GPT2_TOP_MODULES[module]}.{kind}"


def gpt2_name(name: str) -> str:
    """manas' name of a tensor → GPT-2's (without prefixes): the inverse of manas_name."""
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        return f"h.{index}.{_inverse(GPT2_BLOCK_MODULES)[module]}.{kind}"
    module, _, kind = name.rpartition(".")
    return f"{_inverse(GPT2_TOP_MODULES)[module]}.{kind}"


def is_gpt2_linear_weight(gpt2_name: str) -> bool:
    """Weights that Hugging Face's Conv1D stores transposed (in×out)."""
    return gpt2_name.endswith(".weight") and gpt2_name.split(".", 2)[-1].removesuffix(".weight") in GPT2_LINEAR_MODULES


def _inverse(mapping: dict[str, str]) -> dict[str, str]:
    return {value: key for key, value in mapping.items()}


def gpt2_state_to_manas(state: dict[str, torch.Tensor], *, conv1d: bool, source: Path) -> dict[str, torch.Tensor]:
    """Rename (and, from Conv1D, transpose) a GPT-2-named state dict; the tied lm_head must equal the embedding."""
    renamed: dict[str, torch.Tensor] = {}
    head = None
    for name, tensor in state.items():
        bare = name.removeprefix("_orig_mod.").removeprefix("transformer.")
        if bare == TIED_HEAD:
            head = tensor
            continue
        try:
            target = manas_name(bare)
        except (KeyError, ValueError):
            raise CheckpointError(f"{source}: unexpected tensor {name}: not part of a GPT-2 model") from None
        if target is None:
            continue
        renamed[target] = tensor.t() if conv1d and is_gpt2_linear_weight(bare) else tensor
    check_tied_head(head, renamed.get("token_embedding.weight"), source)
    return renamed


# --- convert: a Hugging Face config.json ---------------------------------------------------------------------------


def config_from_hf(values: object, source: Path) -> GPTConfig:
    """A Hugging Face GPT-2 config.json's values, refusing the options manas does not compute."""
    activation = values.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise CheckpointError(
            f"{source}: activation_function {activation!r} is not supported (only {', '.join(HF_ACTIVATIONS)})"
        )
    field = typed_field(values, source)
    n_embd = field("n_embd", int, 768)
    unsupported = {
        "n_inner": values.get("n_inner") not in (None, 4 * n_embd),
        "scale_attn_weights": values.get("scale_attn_weights", True) is not True,
        "scale_attn_by_inverse_layer_idx": values.get("scale_attn_by_inverse_layer_idx", False) is not False,
        "add_cross_attention": values.get("add_cross_attention", False) is not False,
    }
    if changed := [name for name, differs in unsupported.items() if differs]:
        raise CheckpointError(f"{source}: {changed[0]}={values[changed[0]]!r} has no manas equivalent")
    return make_config(
        source,
        vocab_size=field("vocab_size", int, 50257),
        block_size=field("n_positions", int, 1024),
        n_layer=field("n_layer", int, 12),
        n_head=field("n_head", int, 12),
        n_embd=n_embd,
        norm_eps=field("layer_norm_epsilon", float, 1e-5),
        dropout=field("resid_pdrop", float, 0.0),
        gelu_approximate=HF_ACTIVATIONS[activation],
    )


# --- export ----------------------------------------------------------------------------------------------------------


def check_exportable(config: GPTConfig, source: Path) -> None:
    """Refuse what Hugging Face's GPT-2, the twin of learned-position models, cannot compute exactly."""
    if config.n_kv_head != config.n_head:
        raise CheckpointError(
            f"{source}: grouped-query attention (n_kv_head={config.n_kv_head} < n_head={config.n_head}) with learned "
            "positions has no exact equivalent: GPT-2 gives every head its own keys and values (rope models with "
            "grouped-query attention export, as Starcoder2)"
        )


def hf_config(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # OpenAI's name for it, which llama.cpp's GPT-2 converter reads
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd, as manas
        "activation_function": GELU_TO_HF[config.gelu_approximate],
        "layer_norm_epsilon": config.norm_eps,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "resid_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_tensors(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors: Conv1D weights transposed, and zero biases where a bias=False model has none
    (a zero bias adds nothing, so the function is the same). lm_head is tied, so it is left out, as
    save_pretrained does."""
    tensors = {}
    for name, tensor in with_zero_biases(config, state).items():
        if name == TIED:
            continue
        target = gpt2_name(name)
        tensor = tensor.t() if is_gpt2_linear_weight(target) else tensor
        tensors[f"transformer.{target}"] = tensor.detach().contiguous()
    return tensors
