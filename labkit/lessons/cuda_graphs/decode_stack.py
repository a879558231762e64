"""A decoder-like stack for one decode step: many small kernels per layer, as in a real model.

Per layer: RMSNorm, QKV projection, attention of the one new token over a fixed KV cache,
output projection, residual, RMSNorm, SwiGLU MLP, residual: about 20 kernels at batch sizes
where each one is short. Written with plain torch ops on purpose: this is the eager baseline
that CUDA Graphs speed up. (The real model, with RoPE and a paged cache, is labkit.engine's.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.kernels.layer_ops import rms_norm


class DecodeLayer(nn.Module):
    def __init__(self, width: int, n_heads: int, mlp_width: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, width // n_heads
        self.norm1 = nn.Parameter(torch.ones(width))
        self.norm2 = nn.Parameter(torch.ones(width))
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate_up = nn.Linear(width, 2 * mlp_width, bias=False)
        self.down = nn.Linear(mlp_width, width, bias=False)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        # x: [batch, width]; k_cache, v_cache: [batch, n_heads, context, head_dim]
        b = x.shape[0]
        q, _, _ = self.qkv(rms_norm(x, self.norm1)).view(b, 3, self.n_heads, self.head_dim).unbind(1)
        attn = F.scaled_dot_product_attention(q.unsqueeze(2), k_cache, v_cache)
        x = x + self.o(attn.reshape(b, -1))
        gate, up = self.gate_up(rms_norm(x, self.norm2)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DecodeStack(nn.Module):
    """``n_layers`` decode layers sharing one fixed KV cache of ``context`` tokens per row;
    ``stack(x, context=n)`` attends over the first ``n`` cached tokens only (a decode step at a
    shorter context, the length a graph keyed by context bucket freezes)."""

    def __init__(self, n_layers: int = 8, width: int = 2048, n_heads: int = 16,
                 context: int = 256, max_batch: int = 256, mlp_width: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda"):
        super().__init__()
        if width % n_heads:
            raise ValueError(f"width {width} must be a multiple of n_heads {n_heads}")
        mlp_width = mlp_width or int(width * 8 / 3) // 64 * 64
        self.layers = nn.ModuleList(DecodeLayer(width, n_heads, mlp_width) for _ in range(n_layers))
        shape = (max_batch, n_heads, context, width // n_heads)
        self.to(device=device, dtype=dtype)
        # drawn where they live: a cache of thousands of rows is gigabytes, slow to draw on a host
        self.register_buffer("k_cache", torch.randn(shape, device=device, dtype=dtype) * 0.5,
                             persistent=False)
        self.register_buffer("v_cache", torch.randn(shape, device=device, dtype=dtype),
                             persistent=False)
        for p in self.parameters():  # keep activations O(1) through the stack
            if p.dim() == 2:
                nn.init.normal_(p, std=p.shape[1] ** -0.5)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, context: int | None = None) -> torch.Tensor:
        # x: [batch, width] -> [batch, width]
        b, cached = x.shape[0], self.k_cache.shape[2]
        if b > self.k_cache.shape[0]:
            raise ValueError(f"batch {b} > max_batch {self.k_cache.shape[0]} of this stack's cache")
        context = cached if context is None else context
        if not 1 <= context <= cached:
            raise ValueError(f"context {context} must be between 1 and the {cached} tokens this "
                             "stack caches per row")
        k, v = self.k_cache[:b, :, :context], self.v_cache[:b, :, :context]
        for layer in self.layers:
            x = layer(x, k, v)
        return x
