"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model runs on packed tokens: ``input_ids: [num_tokens]`` with their ``positions``, every
sequence of the batch one after the other. Attention is the one step that must know where one
sequence ends and where its earlier keys live, so the caller passes it in as a function
(``AttentionFn``). This file provides two: a contiguous causal reference over a [batch, len]
rectangle, and a varlen one over ``cu_seqlens`` (labkit's FlashAttention kernel on a GPU, the
reference elsewhere). The engine passes a third that writes K/V into a paged cache first.

Each layer is written once (``DecoderLayer.forward``); what varies is its small ops (norms,
RoPE, SiLU): plain torch (``PlainOps``, the references) or three fused Triton kernels
(``FusedOps``), chosen when the model is built (``fused_ops=``).

Weights are fused the way serving engines keep them: ``qkv_proj`` holds the q, k and v rows,
``gate_up_proj`` the gate and up rows, so each is one matmul (``weights.py`` maps the separate
Hugging Face tensors into them).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.attention import (AttentionSpec, flash_attention, flash_attention_ref,
                              select_backend)
from labkit.engine.config import DTYPES, ModelConfig
from labkit.kernels import layer_ops
from labkit.kernels.layer_ops import apply_rope, rope_cos_sin
from labkit.kernels.skinny_linear import MAX_ROWS, skinny_linear

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer, q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, D]) -> [T, Hq, D]; q and k already rotated.

k and v are only this step's new tokens: an attention over a cache stores them and reads the rest.
"""


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[head_dim // 2] float32: the rotation speed of each pair of dimensions."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / theta ** exponents


def split_heads(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int
                ) -> tuple[torch.Tensor, ...]:
    """qkv: [T, (Hq + 2 Hkv) * D] -> views q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, D]."""
    tokens, head_dim = qkv.shape[0], qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return (q.view(tokens, num_q_heads, head_dim), k.view(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim))


class PlainOps:
    """A layer's small ops in plain torch, one kernel per op (about 40 a layer): the references
    of ``kernels/layer_ops.py``, so the plain path is what the fused kernels are checked against.

    A layer calls them as norm-then-project (``norm_linear``, ``norm_gate_up``) and project
    (``linear``), so an ops class may fuse a norm or an activation into the matmul itself."""
    add_rms_norm = staticmethod(layer_ops.add_rms_norm_ref)
    silu_mul = staticmethod(layer_ops.silu_mul_ref)
    linear = staticmethod(F.linear)

    @classmethod
    def norm_linear(cls, x, residual, norm_weight, weight, eps):
        """(``rms_norm(x + residual) @ weight.T``, the new residual)."""
        h, residual = cls.add_rms_norm(x, residual, norm_weight, eps)
        return F.linear(h, weight), residual

    @classmethod
    def norm_gate_up(cls, x, residual, norm_weight, weight, eps):
        """(``silu(gate) * up`` of the normed input, the new residual); ``weight``: gate_up."""
        h, residual = cls.add_rms_norm(x, residual, norm_weight, eps)
        return cls.silu_mul(F.linear(h, weight)), residual

    @staticmethod
    def rotary(positions: torch.Tensor, inv_freq: torch.Tensor):
        return rope_cos_sin(positions, inv_freq)  # once per forward: every layer rotates alike

    @staticmethod
    def rope_qkv(qkv, rotary, num_q_heads: int, num_kv_heads: int):
        q, k, v = split_heads(qkv, num_q_heads, num_kv_heads)
        cos, sin = rotary
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @classmethod
    def norm_qkv_rope(cls, x, residual, norm_weight, weight, eps, rotary, num_q_heads: int,
                      num_kv_heads: int):
        """(q, k, v, the new residual): the norm, the q/k/v projection and RoPE on q and k."""
        qkv, residual = cls.norm_linear(x, residual, norm_weight, weight, eps)
        return (*cls.rope_qkv(qkv, rotary, num_q_heads, num_kv_heads), residual)


class FusedOps(PlainOps):
    """The same ops as three Triton kernels (``kernels/layer_ops.py``): about 10 kernels a layer
    with the matmuls. The residual add rides in the norm, RoPE rotates qkv in place.

    A step of at most ``skinny_rows`` tokens runs its matmuls as ``kernels/skinny_linear.py``,
    which folds the norm before a projection, and SiLU-times-up after gate_up, into the weight
    stream. By default that is one-token steps (batch-1 decode): replayed on the H200 it beats
    cuBLAS (07a's ladder in ``recorded_data/prefill_vs_decode.json``, and
    ``benchmarks/decode_floor.py``), while its 16-row kernel lost at batch 8.
    ``skinny_matmuls(True)`` extends it to 16 rows, ``skinny_matmuls(False)`` turns it off.
    ``rope_in_gemv`` rotates a one-token step's q and k inside its q/k/v GEMV, one kernel fewer
    a layer: the replayed bench_1b step on an H200 gained 1.011x (1.009-1.012, 5 interleaved
    rounds; ``benchmarks/decode_floor.py --rope-kernel`` races it against RoPE's own kernel)."""
    add_rms_norm = staticmethod(layer_ops.add_rms_norm)
    silu_mul = staticmethod(layer_ops.silu_mul)
    skinny_rows = 1
    rope_in_gemv = True  # one row: RoPE inside the q/k/v GEMV, one kernel fewer a layer

    @classmethod
    def _skinny(cls, x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= cls.skinny_rows

    @classmethod
    def linear(cls, x, weight):
        return skinny_linear(x, weight)[0] if cls._skinny(x) else F.linear(x, weight)

    @classmethod
    def norm_linear(cls, x, residual, norm_weight, weight, eps):
        if cls._skinny(x):
            return skinny_linear(x, weight, residual=residual, norm_weight=norm_weight, eps=eps)
        return super().norm_linear(x, residual, norm_weight, weight, eps)

    @classmethod
    def norm_gate_up(cls, x, residual, norm_weight, weight, eps):
        if cls._skinny(x):
            return skinny_linear(x, weight, residual=residual, norm_weight=norm_weight, eps=eps,
                                 gated=True)
        return super().norm_gate_up(x, residual, norm_weight, weight, eps)

    @staticmethod
    def rotary(positions: torch.Tensor, inv_freq: torch.Tensor):
        return positions, inv_freq  # the kernel computes each angle itself

    @staticmethod
    def rope_qkv(qkv, rotary, num_q_heads: int, num_kv_heads: int):
        positions, inv_freq = rotary
        return split_heads(layer_ops.rope_(qkv, positions, inv_freq, num_q_heads, num_kv_heads),
                           num_q_heads, num_kv_heads)

    @classmethod
    def norm_qkv_rope(cls, x, residual, norm_weight, weight, eps, rotary, num_q_heads: int,
                      num_kv_heads: int):
        if cls.rope_in_gemv and cls._skinny(x) and x.shape[0] == 1:
            qkv, residual = skinny_linear(x, weight, residual=residual, norm_weight=norm_weight,
                                          eps=eps, rope=(*rotary, num_q_heads, num_kv_heads))
            return (*split_heads(qkv, num_q_heads, num_kv_heads), residual)
        return super().norm_qkv_rope(x, residual, norm_weight, weight, eps, rotary, num_q_heads,
                                     num_kv_heads)


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

    def forward(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, rotary,
                attention: AttentionFn, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden], the previous block's output, not yet added to ``residual`` (the
        stream; None in the first layer) -> this layer's (x, residual). Each add is done by the
        norm that follows it (``ops.add_rms_norm``), so a fused kernel can do both at once."""
        q, k, v, residual = self.before_attention(x, residual, rotary, ops)
        return self.after_attention(attention(layer, q, k, v), residual, ops)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None, rotary, ops):
        """The layer up to attention -> (q, k, v, residual), q and k rotated. Nothing here
        depends on where a token's sequence starts or what it attends to: only the token
        count fixes the shapes, which is what a piecewise graph keys on."""
        c = self.config
        return ops.norm_qkv_rope(x, residual, self.input_norm, self.qkv_proj, c.rms_norm_eps,
                                 rotary, c.num_attention_heads, c.num_key_value_heads)

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor, ops
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output [T, Hq, D] (or [T, q_size]) -> this layer's (x, residual): the
        output projection, the second norm and the MLP, token by token as well."""
        c = self.config
        out = out.reshape(out.shape[0], c.q_size)
        act, residual = ops.norm_gate_up(ops.linear(out, self.o_proj), residual,
                                         self.post_attention_norm, self.gate_up_proj,
                                         c.rms_norm_eps)
        return ops.linear(act, self.down_proj), residual


class LlamaModel(nn.Module):
    """Parameters are allocated, not initialised: load them (``weights.load_weights``) or fill
    them from a seed (``weights.init_random``).

    ``fused_ops``: run each layer's small ops as three fused Triton kernels (``FusedOps``)
    instead of plain torch (``PlainOps``); ``hidden_states(..., fused_ops=)`` overrides it for a
    call (the engine's runner passes its own choice)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None, *, fused_ops: bool = False):
        super().__init__()
        if config.is_mla:  # its projections and cache differ: built as GQA it would be wrong
            raise ValueError("this config is multi-head latent attention (DeepSeek: kv_lora_rank "
                             f"{config.kv_lora_rank}); LlamaModel computes grouped-query "
                             "attention. Build labkit.engine.mla.MLAModel instead (LLM builds "
                             "it from an MLA config or checkpoint)")
        dtype = model_dtype(config, dtype)
        self.config = config
        self.fused_ops = bool(fused_ops)
        kw = dict(device=device, dtype=dtype)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw))
        self.layers = nn.ModuleList(DecoderLayer(config, device, dtype)
                                    for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, **kw))
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, **kw))
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta,
                                                       device), persistent=False)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attention: AttentionFn, *, fused_ops: bool | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden]. ``fused_ops``:
        which ops run the layers (None: the model's own choice)."""
        ops = self.ops(fused_ops)
        x, residual = F.embedding(input_ids, self.embed_tokens), None
        rotary = ops.rotary(positions, self.inv_freq)
        for i, layer in enumerate(self.layers):
            x, residual = layer(i, x, residual, rotary, attention, ops)
        return ops.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)[0]

    def ops(self, fused_ops: bool | None = None):
        """The small ops the layers run: ``FusedOps`` or ``PlainOps`` (None: the model's own)."""
        return FusedOps if (self.fused_ops if fused_ops is None else fused_ops) else PlainOps

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


@contextmanager
def skinny_matmuls(enabled: bool):
    """``FusedOps`` with its skinny matmuls on for up to 16 rows, or off, inside the block (what
    a CUDA Graph captured inside it freezes): for experiments that measure what they gain."""
    before = FusedOps.skinny_rows
    FusedOps.skinny_rows = MAX_ROWS if enabled else 0
    try:
        yield
    finally:
        FusedOps.skinny_rows = before


def model_dtype(config: ModelConfig, dtype) -> torch.dtype:
    """``dtype`` (a torch dtype or its name, "float16"), or the config's when None."""
    if dtype is None:
        return config.dtype
    named = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if named not in DTYPES.values():
        raise ValueError(f"dtype must be a floating-point torch dtype, one of "
                         f"{list(DTYPES.values())} or its name {list(DTYPES)}, or None for the "
                         f"config's ({config.torch_dtype}); got {dtype!r}")
    return named


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


VARLEN_BACKENDS = ("triton", "reference")  # labkit's FlashAttention kernel, or the definition


def varlen_choice(config: ModelConfig, device, dtype) -> tuple[str, dict[str, list[str]]]:
    """The backend ``backend="auto"`` runs varlen attention with on ``device``, and why the
    other was passed over (``select_backend`` decides; on CPU it passes over the interpreter)."""
    spec = AttentionSpec.here(device, num_q_heads=config.num_attention_heads,
                              num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                              dtype=dtype, block_size=None)
    chosen, passed = select_backend(spec, among=VARLEN_BACKENDS, skip_slow=True, logger=None)
    return chosen.name, passed


def flash_unsupported(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why auto does not run labkit's Triton FlashAttention for this model here; empty when it
    does."""
    return varlen_choice(config, device, dtype)[1].get("triton", [])


def varlen_attention(config: ModelConfig, cu_seqlens: torch.Tensor, device, dtype,
                     backend: str = "auto", max_seqlen: int | None = None) -> AttentionFn:
    if backend not in ("auto", *VARLEN_BACKENDS):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        backend, _ = varlen_choice(config, device, dtype)
    if backend == "triton":
        def attend(layer, q, k, v):
            return flash_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True,
                                   max_seqlen_q=max_seqlen)
    else:
        def attend(layer, q, k, v):
            return flash_attention_ref(q, k, v, cu_seqlens, cu_seqlens, causal=True,
                                       compute_dtype=torch.float32).to(q.dtype)
    return attend
