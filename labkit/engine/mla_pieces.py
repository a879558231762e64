"""An MLA model's forward cut at attention, over static buffers: ``pieces.PiecewiseForward``'s
counterpart for ``labkit.engine.mla.MLAModel``, so piecewise graphs replay its mixed steps too.

The cut is the same: piece 0 embeds the tokens and runs layer 0 up to attention, piece i finishes
layer i - 1 and runs layer i up to attention, piece L applies the final norm. What crosses the
cut is the query ``[q_nope ; q_pe]`` ([T, H, nope + rope]) and the step's latent rows
([T, 1, rank + rope]) into attention, its per-head output ([T, H, v_head_dim]) out, and the
residual stream: attention, eager between the pieces, folds W_UK in for the rows it absorbs and
decompresses the context for the rows of a long prefill (``labkit.engine.mla_prefill``). On a
GPU each piece writes its layer's latent rows into the paged latent cache itself (padding slots
-1 skipped); on CPU the attention between the pieces stores them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.engine.pieces import StaticTokens
from labkit.kernels.layer_ops import rope_cos_sin


class MLAPiecewiseForward(StaticTokens):
    def __init__(self, model, max_tokens: int, cache=None):
        c, dev, dtype = model.config, model.embed_tokens.device, model.embed_tokens.dtype
        super().__init__(max_tokens, dev)
        self.model, self.cache = model, cache
        heads = c.num_attention_heads
        self.q = torch.zeros(max_tokens, heads, c.qk_head_dim, dtype=dtype, device=dev)
        self.latent = torch.zeros(max_tokens, 1, c.latent_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(max_tokens, c.hidden_size, dtype=dtype, device=dev)
        self.attn = torch.zeros(max_tokens, heads, c.v_head_dim, dtype=dtype, device=dev)
        self.hidden = torch.zeros(max_tokens, c.hidden_size, dtype=dtype, device=dev)

    @property
    def layers(self):
        return self.model.model.layers

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    @property
    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.ids, self.positions, self.slots, self.q, self.latent, self.residual, self.attn,
            self.hidden))

    def pieces(self) -> list:
        return [lambda n, i=i: self.piece(i, n) for i in range(self.num_pieces)]

    def piece(self, i: int, n: int) -> None:
        """Piece ``i`` on the first ``n`` rows (see the module docstring)."""
        rotary = rope_cos_sin(self.positions[:n], self.model.inv_freq)
        if i == 0:
            x = F.embedding(self.ids[:n], self.model.embed_tokens)
        else:
            x = self.layers[i - 1].after_attention(self.attn[:n], self.residual[:n])
        if i == len(self.layers):
            self.hidden[:n].copy_(self.model.model.norm(x))
            return
        q, latent, residual = self.layers[i].before_attention(x, rotary)
        self.q[:n].copy_(q)
        self.residual[:n].copy_(residual)
        if self.cache is not None:
            self.cache.write_latent(i, latent[:, 0], self.slots[:n], check=False)
        else:
            self.latent[:n].copy_(latent)

    def attention_views(self, n: int):
        """(q, latent rows, None, out) of the first ``n`` rows, the same in every layer."""
        return self.q[:n], self.latent[:n], None, self.attn[:n]

    def attend(self, layer: int, n: int, attention, views=None) -> None:
        """Layer ``layer``'s attention on the ``n`` real tokens into ``attn`` (the runner's
        MLA attention fills the ``out=`` it is given)."""
        q, latent, _, out = views or self.attention_views(n)
        attention(layer, q, latent, None, out=out)
