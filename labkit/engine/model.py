"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model runs on packed tokens: ``input_ids: [num_tokens]`` with their ``positions``, every
sequence of the batch one after the other. Attention is the one step that must know where one
sequence ends and where its earlier keys live, so the caller passes it in as a function
(``AttentionFn``). This file provides two: a contiguous causal reference over a [batch, len]
rectangle, and a varlen one over ``cu_seqlens`` (labkit's FlashAttention kernel on a GPU, the
reference elsewhere). The engine passes a third that writes K/V into a paged cache first.

Weights are fused the way serving engines keep them: ``qkv_proj`` holds the q, k and v rows,
``gate_up_proj`` the gate and up rows, so each is one matmul (``weights.py`` maps the separate
Hugging Face tensors into them).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.engine.config import ModelConfig

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer, q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, D]) -> [T, Hq, D]; q and k already rotated.

k and v are only this step's new tokens: an attention over a cache stores them and reads the rest.
"""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H]. The mean square is taken in float32: in bf16 it loses the small components."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[head_dim // 2] float32: the rotation speed of each pair of dimensions."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / theta ** exponents


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """positions: [T] -> cos, sin: [T, head_dim], float32 (angles lose precision in bf16)."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # dimension i pairs with i + head_dim/2
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated by its token's angles; cos, sin: [T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        self.config = c
        self.input_norm = nn.Parameter(torch.empty(c.hidden_size, **kw))
        self.qkv_proj = nn.Parameter(torch.empty(c.q_size + 2 * c.kv_size, c.hidden_size, **kw))
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, c.q_size, **kw))
        self.post_attention_norm = nn.Parameter(torch.empty(c.hidden_size, **kw))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size,
                                                     **kw))
        self.down_proj = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size, **kw))

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        c = self.config
        qkv = F.linear(rms_norm(x, self.input_norm, c.rms_norm_eps), self.qkv_proj)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(q.view(-1, c.num_attention_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(-1, c.num_key_value_heads, c.head_dim), cos, sin)
        v = v.view(-1, c.num_key_value_heads, c.head_dim)
        out = attention(layer, q, k, v)
        x = x + F.linear(out.reshape(-1, c.q_size), self.o_proj)
        gate, up = F.linear(rms_norm(x, self.post_attention_norm, c.rms_norm_eps),
                            self.gate_up_proj).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)


class LlamaModel(nn.Module):
    """Parameters are allocated, not initialised: load them (``weights.load_weights``) or fill
    them from a seed (``weights.init_random``)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        dtype = dtype or config.dtype
        self.config = config
        kw = dict(device=device, dtype=dtype)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw))
        self.layers = nn.ModuleList(DecoderLayer(config, device, dtype)
                                    for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, **kw))
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, **kw))
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta,
                                                       device), persistent=False)
        self.fused_ops = False  # see hidden_states

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attention: AttentionFn) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden].

        With ``fused_ops`` set, the small ops run as three fused Triton kernels
        (``labkit.kernels.layer_ops``): about 10 kernels per layer instead of about 40."""
        if self.fused_ops:
            return self._hidden_states_fused(input_ids, positions, attention)
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attention)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def _hidden_states_fused(self, input_ids, positions, attention) -> torch.Tensor:
        from labkit.kernels.layer_ops import add_rms_norm, rope_, silu_mul

        c = self.config
        eps, T = c.rms_norm_eps, input_ids.shape[0]
        h, residual = add_rms_norm(F.embedding(input_ids, self.embed_tokens), None,
                                   self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = rope_(F.linear(h, layer.qkv_proj), positions, self.inv_freq,
                        c.num_attention_heads, c.num_key_value_heads)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            out = attention(i, q.view(T, c.num_attention_heads, c.head_dim),
                            k.view(T, c.num_key_value_heads, c.head_dim),
                            v.view(T, c.num_key_value_heads, c.head_dim))
            h, residual = add_rms_norm(F.linear(out.reshape(T, c.q_size), layer.o_proj),
                                       residual, layer.post_attention_norm, eps)
            mlp = F.linear(silu_mul(F.linear(h, layer.gate_up_proj)), layer.down_proj)
            # this layer's last residual add happens inside the next norm
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h, residual = add_rms_norm(mlp, residual, following, eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab]; an engine passes only each sequence's last token."""
        return F.linear(hidden, self.output_weight)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """input_ids: [batch, len] (equal lengths) -> logits [batch, len, vocab].

        The plain path: causal attention over the rectangle, in float32. ``positions`` ([batch,
        len]) defaults to 0..len-1 for every row.
        """
        batch, length = input_ids.shape
        if positions is None:
            positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        self._check_positions(positions)
        hidden = self.hidden_states(input_ids.reshape(-1), positions.reshape(-1),
                                    contiguous_causal_attention(batch, length))
        return self.compute_logits(hidden).view(batch, length, -1)

    @torch.inference_mode()
    def forward_varlen(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       positions: torch.Tensor | None = None, *, backend: str = "auto",
                       max_seqlen: int | None = None) -> torch.Tensor:
        """input_ids: [T] packed; cu_seqlens: int32 [batch + 1] -> logits [T, vocab].

        ``backend``: "triton" (labkit.attention.flash_attention), "reference", or "auto" (triton
        on a GPU that supports it, the reference otherwise). ``positions`` defaults to 0.. per
        sequence.
        """
        if positions is None:
            positions = positions_in_sequences(cu_seqlens)
        self._check_positions(positions)
        attention = varlen_attention(self.config, cu_seqlens, input_ids.device,
                                     self.embed_tokens.dtype, backend, max_seqlen)
        return self.compute_logits(self.hidden_states(input_ids, positions, attention))

    def _check_positions(self, positions: torch.Tensor) -> None:
        limit = self.config.max_position_embeddings
        if positions.numel() and int(positions.max()) >= limit:
            raise ValueError(f"position {int(positions.max())} is past the model's context of "
                             f"{limit} tokens (max_position_embeddings); shorten the sequence")


def positions_in_sequences(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens: [batch + 1] -> [T]: each token's index inside its own sequence."""
    lens = cu_seqlens.diff().long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lens)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D], computed in float32."""
    group = q.shape[2] // k.shape[2]
    q, k, v = q.float(), k.float().repeat_interleave(group, 2), v.float().repeat_interleave(
        group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    length = q.shape[1]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def contiguous_causal_attention(batch: int, length: int) -> AttentionFn:
    """Attention over a [batch, length] rectangle of tokens packed as [batch * length]."""
    def rectangle(t):
        return t.reshape(batch, length, *t.shape[1:])

    def attend(layer, q, k, v):
        out = causal_attention_ref(rectangle(q), rectangle(k), rectangle(v))
        return out.reshape(q.shape).to(q.dtype)
    return attend


def flash_unsupported(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why labkit's Triton FlashAttention cannot run this model here; empty when it can."""
    from labkit.attention import BACKENDS, AttentionSpec, reasons_against
    device = torch.device(device)
    spec = AttentionSpec.here(num_q_heads=config.num_attention_heads,
                              num_kv_heads=config.num_key_value_heads,
                              head_dim=config.head_dim, dtype=dtype, block_size=None)
    why = reasons_against(BACKENDS["triton"], spec)
    if device.type != "cuda":
        why.append(f"hardware: tensors are on {device.type}; on CPU the kernel runs only in "
                   "Triton's interpreter (slow), so auto uses the reference")
    return why


def varlen_attention(config: ModelConfig, cu_seqlens: torch.Tensor, device, dtype,
                     backend: str = "auto", max_seqlen: int | None = None) -> AttentionFn:
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        backend = "reference" if flash_unsupported(config, device, dtype) else "triton"
    if backend == "triton":
        from labkit.attention import flash_attention

        def attend(layer, q, k, v):
            return flash_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True,
                                   max_seqlen_q=max_seqlen)
    else:
        from labkit.attention import flash_attention_ref

        def attend(layer, q, k, v):
            return flash_attention_ref(q, k, v, cu_seqlens, cu_seqlens, causal=True,
                                       compute_dtype=torch.float32).to(q.dtype)
    return attend
