"""The model's forward cut at attention, over static buffers: what the engine's piecewise graphs
capture (``labkit.graphs.piecewise``).

With L layers there are L + 1 pieces. Piece 0 embeds the tokens and runs layer 0 up to its
attention; piece i finishes layer i - 1 (output projection, norm, MLP) and runs layer i up to its
attention; piece L finishes the last layer and applies the final norm. Each piece reads and
writes the same buffers every time, ``max_tokens`` rows each, of which a step uses its first
``bucket`` rows:

    ids, positions        the step's tokens (the runner copies them in; padding rows are 0)
    slots                 their KV slots (padding rows -1: never written)
    qkv                   the rotated q (and k, v) of the layer whose attention runs next
    residual              the residual stream
    attn                  attention's output, written by the eager attention between pieces
    hidden                the final-normed hidden states, from the last piece

Storing a token's K and V is token by token too (its slot is one more per-token input), so on a
GPU each piece writes its layer's new K/V into the paged cache itself (``cache=``); without a
cache the attention between the pieces stores them. Attention itself (``attend``) runs eagerly
between the pieces on the step's real tokens only: it reads each row's context through its
block table, so it needs the step's metadata, which a graph would have frozen. Padding rows never reach it, and no
token's row depends on another's outside attention, so what padding computes is never read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.engine.model import AttentionFn, LlamaModel, split_heads


class StaticTokens:
    """The per-token inputs every piece reads, ``max_tokens`` rows each: ids, positions, KV
    slots (shared by ``PiecewiseForward``, ``mla_pieces.MLAPiecewiseForward`` and
    ``compiled_pieces.CompiledPiecewise``, whose compiled forward takes int32 slots as the
    step's metadata holds them: another dtype would be another compilation)."""

    def __init__(self, max_tokens: int, device, slot_dtype: torch.dtype = torch.int64):
        self.max_tokens = max_tokens
        self.ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.slots = torch.full((max_tokens,), -1, dtype=slot_dtype, device=device)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
             bucket: int) -> None:
        """The step's tokens into the static inputs; rows up to ``bucket`` padded with 0 (slot
        -1)."""
        n = input_ids.shape[0]
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slot_mapping)
        if n < bucket:
            self.ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slots[n:bucket].fill_(-1)


class PiecewiseForward(StaticTokens):
    def __init__(self, model: LlamaModel, ops, max_tokens: int, cache=None):
        c, dev, dtype = model.config, model.embed_tokens.device, model.embed_tokens.dtype
        super().__init__(max_tokens, dev)
        self.model, self.ops, self.cache = model, ops, cache
        self.qkv = torch.zeros(max_tokens, c.q_size + 2 * c.kv_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(max_tokens, c.hidden_size, dtype=dtype, device=dev)
        self.attn = torch.zeros(max_tokens, c.q_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(max_tokens, c.hidden_size, dtype=dtype, device=dev)

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    @property
    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.ids, self.positions, self.slots, self.qkv, self.residual, self.attn,
            self.hidden))

    def pieces(self) -> list:
        return [lambda n, i=i: self.piece(i, n) for i in range(self.num_pieces)]

    def _keep(self, layer: int, n: int, q, k, v, residual) -> None:
        """What the attention after the piece reads, into the static buffers: q (and k, v
        when it stores them itself) and the residual stream."""
        c = self.model.config
        kept_q, kept_k, kept_v = split_heads(self.qkv[:n], c.num_attention_heads,
                                             c.num_key_value_heads)
        kept_q.copy_(q)
        if self.cache is not None:
            self.cache.write(layer, k, v, self.slots[:n], check=False)
        else:
            kept_k.copy_(k)
            kept_v.copy_(v)
        self.residual[:n].copy_(residual)

    def piece(self, i: int, n: int) -> None:
        """Piece ``i`` on the first ``n`` rows (see the module docstring)."""
        model, ops, layers = self.model, self.ops, self.model.layers
        rotary = ops.rotary(self.positions[:n], model.inv_freq)
        if i == 0:
            x, residual = F.embedding(self.ids[:n], model.embed_tokens), None
        else:
            x, residual = layers[i - 1].after_attention(self.attn[:n], self.residual[:n], ops)
        if i < len(layers):
            self._keep(i, n, *layers[i].before_attention(x, residual, rotary, ops))
        else:
            hidden = ops.add_rms_norm(x, residual, model.norm, model.config.rms_norm_eps)[0]
            self.hidden[:n].copy_(hidden)

    def attention_views(self, n: int):
        """(q, k, v, out) of the first ``n`` rows, as every layer's attention reads and writes
        them: the same buffers in every layer, so a step makes these views once."""
        c = self.model.config
        q, k, v = split_heads(self.qkv[:n], c.num_attention_heads, c.num_key_value_heads)
        return q, k, v, self.attn[:n].view(q.shape)

    def attend(self, layer: int, n: int, attention: AttentionFn, views=None) -> None:
        """Layer ``layer``'s attention on the ``n`` real tokens, into ``attn``: ``attention``
        fills the ``out=`` it is given (the runner's does; labkit's kernel writes there, with no
        copy). ``views``: this step's ``attention_views(n)``, made once for every layer."""
        q, k, v, out = views or self.attention_views(n)
        attention(layer, q, k, v, out=out)
