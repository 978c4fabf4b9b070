"""A decoder-only, pre-norm GPT: GPT-2's architecture, or rotary positions with grouped-query attention, and the
Llama family's choices (RMSNorm, a SwiGLU MLP, an untied output layer, biases on q, k, v only, its own head size)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.config import GPTConfig, parameter_count
from .rotary import rope_tables, rotate_pairs


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout while training; otherwise x itself, without dispatching an op (decoding runs this ~20 times a
    token, and a no-op module call costs as much as a small product)."""
    return F.dropout(x, p, training=True) if training and p else x


class CausalSelfAttention(nn.Module):
    """Multi-head attention with one fused q|k|v projection; n_kv_head < n_head shares each K/V head among
    n_head / n_kv_head consecutive query heads (query head h reads kv head h // group, as repeat_interleave does)."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.window = config.window(layer)  # the positions a query attends over, its own included; None: all
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_size = config.head_size
        kv_width = config.n_kv_head * config.head_size
        self.qkv = nn.Linear(config.n_embd, config.attention_width + 2 * kv_width, bias=config.has_qkv_bias)
        self.output = nn.Linear(config.attention_width, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        # the scores' scale: None, SDPA's own 1/√hs; or 1/√attention_scalar (Gemma 3 27B)
        self.scale = None if config.attention_scalar is None else 1 / math.sqrt(config.attention_scalar)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """Every head of q|k|v, (B, n_head + 2 n_kv_head, T, hs): they lie side by side, queries first, then keys,
        then values, so one view gives them all."""
        B, T, _ = x.shape
        return self.qkv(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_size).transpose(1, 2)

    def project(self, heads: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, n_head, T, hs), keys and values (B, n_kv_head, T, hs) for positions start_pos..; with qk_norm
        each query and key head RMS-normed first (Qwen3)."""
        qk = heads[:, : self.n_head + self.n_kv_head]
        if self.qk_norm:
            q, k = qk.split((self.n_head, self.n_kv_head), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = self.encode_positions(qk, start_pos).split((self.n_head, self.n_kv_head), dim=1)
        return q, k, heads[:, self.n_head + self.n_kv_head :]

    def encode_positions(self, qk: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Queries and keys as attention sees them; learned positions were already added to the embeddings."""
        return qk

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each query head's mix of values, (B, n_head, T, hs)."""
        # Several queries are always the newest positions of the keys (a prompt), so the causal mask applies;
        # a single query is the newest position and sees every key: masking it upper-left would hide its past.
        T, S = q.size(2), k.size(2)
        mask = None
        if self.window is not None and S > self.window:  # each query sees its last `window` positions
            queries = torch.arange(S - T, S, device=q.device)[:, None]
            keys = torch.arange(S, device=q.device)[None, :]
            mask = (keys <= queries) & (keys > queries - self.window)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
            enable_gqa=self.n_kv_head != self.n_head,
        )

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """The heads (B, n_head, T, hs) side by side again, through the output projection: (B, T, C)."""
        B, _, T, _ = y.shape
        return dropout(self.output(y.transpose(1, 2).reshape(B, T, -1)), self.dropout, self.training)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache=None) -> torch.Tensor:
        """With a layer cache (anything with append(k, v) -> (all_k, all_v)), attend over the cached past too."""
        q, k, v = self.project(self.heads(x), start_pos)
        if cache is not None:
            k, v = cache.append(k, v)
        return self.merge(self.attend(q, k, v))

    def forward_rows(self, x: torch.Tensor, positions: list[int], caches: list) -> torch.Tensor:
        """One new position for each of several independent sequences, x (R, 1, C): row r sits at positions[r]
        and attends over its own cache, caches[r]. The projections run on all rows at once (they read each weight
        once for all), attention row by row, each over exactly its own past, as it would alone."""
        heads = self.heads(x)
        ys = []
        for row, (position, cache) in enumerate(zip(positions, caches)):
            q, k, v = self.project(heads[row : row + 1], position)
            ys.append(self.attend(q, *cache.append(k, v)))
        return self.merge(torch.cat(ys))


class RotaryAttention(CausalSelfAttention):
    """Causal self-attention whose queries and keys are rotated by their absolute position."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.rope_base, self.rope_factors = config.rope_base_of(layer), config.rope_factors_of(layer)
        self.block_size, self.rotary, self.rope_scale = config.block_size, config.rotary_dims, config.rope_scale
        # Derived from the config, so never saved: a checkpoint holds only learned weights. Built for the positions
        # used so far (doubling, up to block_size), so a block_size that no tensor backs allocates nothing.
        self.register_buffer("cos", torch.empty(0, self.rotary), persistent=False)
        self.register_buffer("sin", torch.empty(0, self.rotary), persistent=False)

    def encode_positions(self, qk: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Rotate queries and keys (B, heads, T, hs) together: they share positions, and one call is half the ops.
        With a partial rotary (Phi-3) only each head's first `rotary` dimensions turn."""
        end = start_pos + qk.size(2)
        if end > self.cos.size(0):
            positions = min(max(end, 2 * self.cos.size(0)), self.block_size)
            with torch.inference_mode(False):  # plain tensors: a later training step may save them for backward
                cos, sin = rope_tables(self.rotary, positions, self.rope_base, self.rope_factors, self.rope_scale)
            self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        positions = slice(start_pos, end)
        cos, sin = self.cos[positions].to(qk.dtype), self.sin[positions].to(qk.dtype)
        if self.rotary == self.head_size:
            return rotate_pairs(qk, cos, sin)
        turned, kept = qk.split((self.rotary, self.head_size - self.rotary), dim=-1)
        return torch.cat((rotate_pairs(turned, cos, sin), kept), dim=-1)


class FeedForward(nn.Module):
    """GPT-2's MLP, down(gelu(up(x))); with mlp="swiglu" Llama's gated one, down(silu(gate(x)) · up(x)); with
    mlp="geglu" Gemma's, down(gelu(gate(x)) · up(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.mlp = config.mlp
        self.gated = config.mlp != "gelu"
        if self.gated:
            self.gate = nn.Linear(config.n_embd, config.ffn_width, bias=config.bias)
        self.up = nn.Linear(config.n_embd, config.ffn_width, bias=config.bias)
        self.down = nn.Linear(config.ffn_width, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.gelu_approximate = config.gelu_approximate

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp == "swiglu":
            return F.silu(self.gate(x)) * self.up(x)
        if self.mlp == "geglu":
            return F.gelu(self.gate(x), approximate=self.gelu_approximate) * self.up(x)
        return F.gelu(self.up(x), approximate=self.gelu_approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(self.down(self.activation(x)), self.dropout, self.training)


def norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """Attention then the MLP, each on the normed residual stream and added back to it; with post_norms (Gemma)
    each one's output normed too before it is added."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_attention = norm(config)
        kind = RotaryAttention if config.uses_rope(layer) else CausalSelfAttention
        self.attention = kind(config, layer)
        self.ln_ffn = norm(config)
        self.ffn = FeedForward(config)
        self.post_norms = config.post_norms
        if config.post_norms:
            self.ln_attention_out, self.ln_ffn_out = norm(config), norm(config)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache=None) -> torch.Tensor:
        return self.feed_forward(x + self.attended(self.attention(self.ln_attention(x), start_pos, cache)))

    def forward_rows(self, x: torch.Tensor, positions: list[int], caches: list) -> torch.Tensor:
        return self.feed_forward(
            x + self.attended(self.attention.forward_rows(self.ln_attention(x), positions, caches))
        )

    def attended(self, y: torch.Tensor) -> torch.Tensor:
        return self.ln_attention_out(y) if self.post_norms else y

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ffn(self.ln_ffn(x))
        return x + (self.ln_ffn_out(y) if self.post_norms else y)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        if config.position_encoding == "learned":
            self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.final_norm = norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, parameter in self.named_parameters():
            if name.endswith(("attention.output.weight", "ffn.down.weight")):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """The weights' values (engine.config.parameter_count)."""
        return parameter_count(self.config)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, scaled by embedding_scale where the model has one (Gemma's √n_embd, as a float32
        multiplies them)."""
        x = self.token_embedding(idx)
        scale = self.config.embedding_scale
        return x if scale is None else x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)

    def hidden_states(self, idx: torch.Tensor, start_pos: int = 0, caches=None) -> torch.Tensor:
        """The final-normed residual stream for tokens at positions start_pos..start_pos+T-1."""
        x = self.embed(idx)
        if self.config.position_encoding == "learned":
            x = x + self.position_embedding.weight[start_pos : start_pos + idx.size(1)]
        x = dropout(x, self.config.dropout, self.training)
        for i, block in enumerate(self.blocks):
            x = block(x, start_pos, None if caches is None else caches[i])
        return self.final_norm(x)

    def decode_rows(self, idx: torch.Tensor, positions: list[int], caches: list[list]) -> torch.Tensor:
        """One new token for each of several independent sequences, idx (R, 1): row r at positions[r], with its
        own layer caches caches[r]; the logits (R, 1, vocab)."""
        x = self.embed(idx)
        if self.config.position_encoding == "learned":
            x = x + self.position_embedding.weight[torch.tensor(positions, device=idx.device)][:, None]
        for i, block in enumerate(self.blocks):
            x = block.forward_rows(x, positions, [layers[i] for layers in caches])
        return self.lm_head(self.final_norm(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Full causal forward over idx (B, T ≤ block_size): logits (B, T, vocab), and the loss if targets given."""
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence of {idx.size(1)} tokens exceeds block_size {self.config.block_size}")
        logits = self.lm_head(self.hidden_states(idx))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss


@torch.no_grad()
def use_decode_layout(model: GPT) -> GPT:
    """Store each float32 weight matrix transposed in memory, (in, out), keeping its shape, values and tying.

    F.linear then multiplies by a contiguous (in, out) matrix, which CPU BLAS streams about 1.5× faster in the
    matrix-vector products of decoding (13 → 8 ms for GPT-2's lm_head on this project's 2-core machine).
    Half-precision weights keep nn.Linear's (out, in): torch's bfloat16 and float16 kernels stream that layout
    faster (GPT-2-124M decode on a 2-core Xeon, 2 threads: bfloat16 23.2 vs 18.6 tok/s, float16 37.5 vs 20.3).
    """
    for module in model.modules():
        if (
            isinstance(module, (nn.Linear, nn.Embedding))
            and module.weight.dtype == torch.float32
            and not module.weight.t().is_contiguous()
        ):
            module.weight.data = module.weight.data.t().contiguous().t()
    return model
