"""A model's shape: GPTConfig, and the tensors a checkpoint of it holds. Free of torch, so that reading a
checkpoint's header (and running it on the native core) never imports it."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields

POSITION_ENCODINGS = ("learned", "rope")
GELU_APPROXIMATIONS = ("tanh", "none")  # F.gelu's `approximate` values
NORMS = ("layernorm", "rmsnorm")  # GPT-2's LayerNorm; Llama's RMSNorm (weight only, no mean subtracted)
# GPT-2's up → GELU → down; Llama's down(silu(gate(x)) · up(x)); Gemma's down(gelu(gate(x)) · up(x))
MLPS = ("gelu", "swiglu", "geglu")
# The fields Llama-family models added (FORMAT.md, version 3), with the values that mean GPT-2's block. A config
# that leaves them so is written without them, as earlier versions wrote it.
FAMILY_DEFAULTS = {
    "norm": "layernorm",
    "mlp": "gelu",
    "ffn_hidden": None,
    "head_dim": None,
    "tie_embeddings": True,
    "qkv_bias": None,
    "qk_norm": False,
    "rope_factors": None,
    "nope_layers": None,
    "embedding_scale": None,
    "post_norms": False,
    "sliding_window": None,
    "window_layers": None,
    "local_rope_base": None,
    "partial_rotary": None,
    "rope_scale": None,
    "attention_scalar": None,
}
# The longest context any released model uses (2^20 positions). No tensor backs block_size with rope, so a bound
# keeps a file's claim from sizing what position-dependent state there is (the static KV cache's window).
MAX_BLOCK_SIZE = 1 << 20

# int4: groups of 32 values along a row, as llama.cpp's q4_0 blocks. On the shipped model 32, 64 and 128 cost the
# same held-out loss within noise (+0.003 nats/char), and on GPT-2's shape one decode step's products take 4.2, 4.3
# and 4.6 ms (1 thread, 2-core AMD EPYC): the smallest group is the most faithful for no measurable cost, and it
# divides the width of every model whose n_embd is a multiple of 32.
INT4_GROUP_SIZE = 32
QUANTIZATIONS = ("int8", "int4")  # what manas runs, by the names flags and files give them


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_kv_head: int | None = None  # None: plain multi-head attention (n_kv_head = n_head)
    n_embd: int
    position_encoding: str = "learned"
    rope_base: float = 10000.0
    bias: bool = True
    norm_eps: float = 1e-5
    gelu_approximate: str = "tanh"  # "tanh": GPT-2's GELU; "none": the exact erf GELU (nanoGPT's nn.GELU())
    dropout: float = 0.0
    norm: str = "layernorm"
    mlp: str = "gelu"
    ffn_hidden: int | None = None  # the MLP's hidden width; None: 4 n_embd
    head_dim: int | None = None  # None: n_embd / n_head
    tie_embeddings: bool = True  # the output layer is the token embedding (GPT-2), or a matrix of its own
    qkv_bias: bool | None = None  # biases on q, k, v; None: as `bias` (Qwen2: true with bias false)
    qk_norm: bool = False  # RMSNorm over each query and key head before rope, one weight per head dimension (Qwen3)
    # Each rope pair's frequency divided by its factor (head size / 2 of them): Llama 3.1's and 3.2's scaled rope,
    # as llama.cpp's rope_freqs holds it, and Gemma 3's linear one (its global layers'); None: every factor 1.
    rope_factors: list[float] | None = None
    nope_layers: list[int] | None = None  # the layers whose attention has no rope, ascending (SmolLM3: every fourth)
    embedding_scale: float | None = None  # the token embedding multiplied by it, float32 (Gemma: √n_embd)
    post_norms: bool = False  # a norm on the attention's and the MLP's outputs before each residual add (Gemma)
    # Attention over the last sliding_window positions only (the position itself included), in the layers
    # window_layers lists (Gemma 3: five of six), whose rope turns at local_rope_base where given (Gemma 3's 10,000)
    sliding_window: int | None = None
    window_layers: list[int] | None = None
    local_rope_base: float | None = None
    # Rope on the first partial_rotary of each head's dimensions only (Phi-4-mini: 0.75), the rest passed through;
    # and cos and sin multiplied by rope_scale (LongRoPE's attention factor)
    partial_rotary: float | None = None
    rope_scale: float | None = None
    # Attention scores scaled by 1/√attention_scalar (Gemma 3 27B's query_pre_attn_scalar, 168 beside heads of 128);
    # None: by 1/√(head size)
    attention_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        self._check_types()
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "head_dim"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE} (2^20), got {self.block_size}")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(
                f"position_encoding must be one of {', '.join(POSITION_ENCODINGS)}, got {self.position_encoding!r}"
            )
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.position_encoding == "rope" and self.head_size % 2:
            raise ValueError(f"the head size ({self.head_size}) must be even with rope position encoding")
        self._check_partial_rotary()
        if not 0 < self.rope_base < math.inf:
            raise ValueError(f"rope_base must be positive, got {self.rope_base!r}")
        if not 0 < self.norm_eps < math.inf:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")
        if self.gelu_approximate not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"gelu_approximate must be one of {', '.join(GELU_APPROXIMATIONS)}, got {self.gelu_approximate!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        for name, allowed in (("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.mlp == "geglu" and self.gelu_approximate != "tanh":
            raise ValueError("mlp 'geglu' needs gelu_approximate 'tanh' (Gemma's)")
        if self.qk_norm and self.norm != "rmsnorm":
            raise ValueError("qk_norm needs norm 'rmsnorm' (the query and key norms are RMSNorms)")
        self._check_rope_factors()
        self._check_layers("nope_layers")
        self._check_layers("window_layers")
        self._check_windows()
        if self.nope_layers is not None and self.position_encoding != "rope":
            raise ValueError("nope_layers needs position_encoding 'rope'")
        if self.attention_scalar is not None and not 0 < self.attention_scalar < math.inf:
            raise ValueError(f"attention_scalar must be a positive finite number, got {self.attention_scalar!r}")
        if self.embedding_scale is not None and not 0 < self.embedding_scale < math.inf:
            raise ValueError(f"embedding_scale must be a positive finite number, got {self.embedding_scale!r}")
        if self.post_norms and self.norm != "rmsnorm":
            raise ValueError("post_norms needs norm 'rmsnorm' (Gemma's)")

    def _check_partial_rotary(self) -> None:
        """A fraction of the head that rotates an even count of its dimensions, and a positive cos/sin scale; each
        with rope positions."""
        for name in ("partial_rotary", "rope_scale"):
            if getattr(self, name) is not None and self.position_encoding != "rope":
                raise ValueError(f"{name} needs position_encoding 'rope'")
        if self.partial_rotary is not None:
            if not 0 < self.partial_rotary <= 1:
                raise ValueError(f"partial_rotary must be in (0, 1], got {self.partial_rotary!r}")
            if self.rotary_dims < 2 or self.rotary_dims % 2:
                raise ValueError(
                    f"partial_rotary {self.partial_rotary!r} of a head of {self.head_size} rotates {self.rotary_dims} "
                    "dimensions: rope turns pairs, so it must be an even count"
                )
        if self.rope_scale is not None and not 0 < self.rope_scale < math.inf:
            raise ValueError(f"rope_scale must be a positive finite number, got {self.rope_scale!r}")

    @property
    def rotary_dims(self) -> int:
        """The dimensions of each head that rope turns: the first ones (all without partial_rotary)."""
        return int(self.head_size * self.partial_rotary) if self.partial_rotary is not None else self.head_size

    def _check_layers(self, name: str) -> None:
        """A list of layer indices: each once, ascending, below n_layer."""
        previous = -1
        for layer in getattr(self, name) or ():
            if isinstance(layer, bool) or not isinstance(layer, int) or not previous < layer < self.n_layer:
                raise ValueError(
                    f"{name} must list layer indices from 0 to {self.n_layer - 1} (n_layer − 1), each once and "
                    f"ascending, got {layer!r}"
                )
            previous = layer

    def _check_windows(self) -> None:
        """sliding_window and window_layers together, the window shorter than the context; a local rope base with
        rope positions, in window layers."""
        if (self.sliding_window is None) != (self.window_layers is None):
            raise ValueError("sliding_window and window_layers come together: the window, and the layers it is in")
        # a window as long as the context (a --ctx below the model's window) masks nothing, and is allowed
        if self.sliding_window is not None and not 0 < self.sliding_window <= MAX_BLOCK_SIZE:
            raise ValueError(f"sliding_window must be from 1 to {MAX_BLOCK_SIZE}, got {self.sliding_window!r}")
        if self.local_rope_base is not None:
            if self.position_encoding != "rope" or self.window_layers is None:
                raise ValueError("local_rope_base needs position_encoding 'rope' and window_layers")
            if not 0 < self.local_rope_base < math.inf:
                raise ValueError(f"local_rope_base must be positive, got {self.local_rope_base!r}")

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates its queries and keys."""
        return self.position_encoding == "rope" and layer not in (self.nope_layers or ())

    def window(self, layer: int) -> int | None:
        """The positions layer `layer` attends over (its own included), None for the whole context."""
        return self.sliding_window if layer in (self.window_layers or ()) else None

    def has_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` turns its own rope: a window layer of a model with local_rope_base, at that base and
        unscaled (Gemma 3's local layers; its rope_factors scale the global layers only)."""
        return self.local_rope_base is not None and self.window(layer) is not None

    def rope_base_of(self, layer: int) -> float:
        return self.local_rope_base if self.has_local_rope(layer) else self.rope_base

    def rope_factors_of(self, layer: int) -> list[float] | None:
        return None if self.has_local_rope(layer) else self.rope_factors

    def _check_rope_factors(self) -> None:
        """Positive and finite, one per rope pair, with rope positions."""
        if self.rope_factors is None:
            return
        if self.position_encoding != "rope":
            raise ValueError("rope_factors needs position_encoding 'rope'")
        if len(self.rope_factors) != self.rotary_dims // 2:
            raise ValueError(
                f"rope_factors must hold one factor per rope pair, {self.rotary_dims // 2} (rotary dimensions / 2), "
                f"got {len(self.rope_factors)}"
            )
        for factor in self.rope_factors:
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
                raise ValueError(f"rope_factors must be positive finite numbers, got {factor!r}")

    def _check_types(self) -> None:
        """Each field has its declared type exactly: a bool is not an int, a string is not a bool ("false" would be
        true); an int is accepted where a float is declared."""
        for field in fields(self):
            value = getattr(self, field.name)
            kind = field.type.split(" | ")[0]
            if value is None and field.type.endswith("| None"):
                continue
            if kind.startswith("list"):  # its items are checked with the field
                if not isinstance(value, list):
                    raise ValueError(f"{field.name} must be a list, got {value!r}")
                continue
            valid = {
                "int": isinstance(value, int) and not isinstance(value, bool),
                "float": isinstance(value, (int, float)) and not isinstance(value, bool),
                "bool": isinstance(value, bool),
                "str": isinstance(value, str),
            }[kind]
            if not valid:
                raise ValueError(f"{field.name} must be {'an' if kind == 'int' else 'a'} {kind}, got {value!r}")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden features."""
        return self.ffn_hidden or 4 * self.n_embd

    @property
    def attention_width(self) -> int:
        """The query heads side by side: n_head × head size (n_embd unless head_dim says otherwise)."""
        return self.n_head * self.head_size

    @property
    def row_widths(self) -> dict[str, int]:
        """The lengths of the weight matrices' rows, by what they are: int4's groups must divide each."""
        return {"n_embd": self.n_embd, "the MLP's width": self.ffn_width, "the heads' width": self.attention_width}

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def is_gpt2_family(self) -> bool:
        """Whether the block is GPT-2's (FORMAT.md versions 1 and 2 describe it), every Llama-family field at its
        default."""
        return all(getattr(self, name) == value for name, value in FAMILY_DEFAULTS.items())

    def to_dict(self) -> dict:
        """The fields, the Llama-family ones only where they differ from GPT-2's block (as earlier versions wrote)."""
        return {
            name: value
            for name, value in asdict(self).items()
            if name not in FAMILY_DEFAULTS or value != FAMILY_DEFAULTS[name]
        }

    @classmethod
    def from_dict(cls, values: dict) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**values)


def parameter_shapes(config: GPTConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The name and shape of every persistent tensor of GPT(config), in state_dict order, lm_head only when untied:
    what a checkpoint must hold, known without building the model. A generator, so that a config claiming a
    million layers costs nothing until a file's tensors run out."""
    C, kv_width, hidden = config.n_embd, config.n_kv_head * config.head_size, config.ffn_width

    def linear(
        name: str, out_features: int, in_features: int, bias: bool = config.bias
    ) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield f"{name}.weight", (out_features, in_features)
        if bias:
            yield f"{name}.bias", (out_features,)

    def norm(name: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield f"{name}.weight", (C,)
        if config.bias and config.norm == "layernorm":  # RMSNorm has no bias
            yield f"{name}.bias", (C,)

    yield "token_embedding.weight", (config.vocab_size, C)
    if config.position_encoding == "learned":
        yield "position_embedding.weight", (config.block_size, C)
    for i in range(config.n_layer):
        yield from norm(f"blocks.{i}.ln_attention")
        yield from linear(f"blocks.{i}.attention.qkv", config.attention_width + 2 * kv_width, C, config.has_qkv_bias)
        if config.qk_norm:
            yield f"blocks.{i}.attention.q_norm.weight", (config.head_size,)
            yield f"blocks.{i}.attention.k_norm.weight", (config.head_size,)
        yield from linear(f"blocks.{i}.attention.output", C, config.attention_width)
        if config.post_norms:
            yield from norm(f"blocks.{i}.ln_attention_out")
        yield from norm(f"blocks.{i}.ln_ffn")
        if config.mlp != "gelu":
            yield from linear(f"blocks.{i}.ffn.gate", hidden, C)
        yield from linear(f"blocks.{i}.ffn.up", hidden, C)
        yield from linear(f"blocks.{i}.ffn.down", C, hidden)
        if config.post_norms:
            yield from norm(f"blocks.{i}.ln_ffn_out")
    yield from norm("final_norm")
    if not config.tie_embeddings:
        yield "lm_head.weight", (config.vocab_size, C)


def parameter_count(config: GPTConfig) -> int:
    """The weights' values, counted as in the float model whatever their storage: a tied output layer is the token
    embedding, and quantization's scales and zeros are not parameters."""
    return sum(math.prod(shape) for _, shape in parameter_shapes(config))


def as_float32(value: float) -> float:
    """value as a float32 file stores it (GGUF, rope_factors): infinite beyond its range, 0 below its smallest."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def stored_names(kind: str) -> tuple[str, ...]:
    """The tensors a quantized matrix is stored as, by suffix: `weight` first (FORMAT.md, version 2)."""
    return ("weight", "scales") if kind == "int8" else ("weight", "scales", "zeros")
