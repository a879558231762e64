"""DeepSeek's multi-head latent attention (MLA) and a dense decoder built on it.

Each token compresses its hidden state into one latent ``c_kv`` (``kv_lora_rank`` wide) shared by
every head, plus one rotary key ``k_pe`` (``qk_rope_head_dim``), and only those are cached:
576 values a token and layer in DeepSeek-V3. ``kv_b_proj`` holds, per head h, the rows
``W_UK[h]: [qk_nope_head_dim, kv_lora_rank]`` and ``W_UV[h]: [v_head_dim, kv_lora_rank]``::

    k_h = [W_UK[h] c_kv ; k_pe]      v_h = W_UV[h] c_kv
    q_h . k_h = (W_UK[h]^T q_nope_h) . c_kv + q_pe_h . k_pe    (associativity)
    sum_j p_j v_h(j) = W_UV[h] (sum_j p_j c_kv(j))

so attention can run two ways, which give the same numbers:
- ``decompressed``: up-project every cached latent into per-head keys and values, then ordinary
  causal attention. Prefill does this: it computes K and V once for many queries.
- ``absorbed``: fold ``W_UK`` into the query, attend straight over the paged latent cache
  (``paged_mla_attention``, one shared 576-wide row per token, MQA-like), apply ``W_UV`` to the
  latent output. Decode does this: it reads the cache once per step, never per head.
A paged step splits its sequences between the two by their new tokens
(``labkit.engine.mla_prefill``).

Parameter names are transformers' ``DeepseekV3ForCausalLM``'s, so its state dict loads as is.
RoPE follows it too: with ``rope_interleave`` the rotary dims come in adjacent pairs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.attention import BACKENDS
from labkit.engine.config import ModelConfig
from labkit.engine.mla_prefill import (DECOMPRESS_MIN_NEW_TOKENS, causal_attention_varlen,
                                       latent_step_attention)
from labkit.engine.model import model_dtype, rope_inv_freq
from labkit.kernels.layer_ops import apply_rope, rms_norm, rope_cos_sin
from labkit.kernels.store_kv import store_kv_ref

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm keep the default eps, not rms_norm_eps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **kw):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size, **kw)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """x: [T, H, rope] rotated by each token's angles (cos, sin: [T, rope]). Interleaved pairs
    (x0, x1), (x2, x3)... are gathered into halves first: the output layout changes, but q and
    k change alike, so every score is what DeepSeek's pairwise rotation gives."""
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return apply_rope(x, cos, sin)


def write_latents(latent_cache: torch.Tensor, slot_mapping: torch.Tensor, c_kv: torch.Tensor,
                  k_pe: torch.Tensor) -> None:
    """Store a step's latents. latent_cache: [num_blocks, block_size, kv_lora_rank + rope];
    slot_mapping: [T], ``block_id * block_size + offset``; c_kv: [T, kv_lora_rank];
    k_pe: [T, rope]."""
    rows = latent_cache[:, :, None]  # one "head": the paged K/V store's layout, a view
    row = torch.cat([c_kv, k_pe], dim=-1).to(latent_cache.dtype)[:, None]
    store_kv_ref(row, row, rows, rows, slot_mapping, check=False)


def step_positions(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[T]: each new token's position; a sequence's new tokens are the last of its seq_lens."""
    lens_q = cu_seqlens_q.diff().long()
    starts = (seq_lens.long() - lens_q).repeat_interleave(lens_q)
    offsets = torch.arange(int(cu_seqlens_q[-1]), device=seq_lens.device)
    return starts + offsets - cu_seqlens_q[:-1].long().repeat_interleave(lens_q)


def slot_mapping(block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T]: where each new token's latent goes in the flattened paged cache."""
    seq = torch.arange(block_tables.shape[0], device=positions.device).repeat_interleave(
        cu_seqlens_q.diff().long())
    blocks = block_tables.long()[seq, positions // block_size]
    return blocks * block_size + positions % block_size


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        self.config, self.heads = c, c.num_attention_heads
        self.scale = c.qk_head_dim ** -0.5  # plain RoPE: no YaRN mscale (config refuses YaRN)
        q_out = self.heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False, **kw)
        else:  # the query is low-rank too: down, normalise, up
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.latent_size, bias=False, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.heads * (c.qk_nope_head_dim
                                                                 + c.v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(self.heads * c.v_head_dim, c.hidden_size, bias=False, **kw)

    def project(self, x: torch.Tensor, rotary):
        """x: [T, hidden] -> q_nope [T, H, nope], q_pe [T, H, rope] (rotated), c_kv [T, rank]
        (normalised), k_pe [T, rope] (rotated): everything attention needs, token by token."""
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.heads, c.qk_head_dim).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        cos, sin = rotary
        q_pe = rotate(q_pe, cos, sin, c.rope_interleave)
        k_pe = rotate(k_pe[:, None, :], cos, sin, c.rope_interleave)[:, 0]
        return q_nope, q_pe, self.kv_a_layernorm(c_kv), k_pe

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, nope, rank] and W_UV [H, v_head_dim, rank]."""
        c = self.config
        w = self.kv_b_proj.weight.view(self.heads, c.qk_nope_head_dim + c.v_head_dim,
                                       c.kv_lora_rank)
        return w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)

    def fold_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, nope + rope] -> [T, H, rank + rope]: W_UK folded into q_nope (absorbed)."""
        c = self.config
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        w_uk, _ = self.up_projections()
        return torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)

    def unfold_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """The absorbed attention's latent output [T, H, rank] -> [T, H, v_head_dim]: W_UV."""
        _, w_uv = self.up_projections()
        return torch.einsum("thr,hvr->thv", out_latent, w_uv)

    def decompress(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [S, rank + rope] (c_kv then k_pe) -> per-head keys [S, H, nope + rope]
        (the rope key shared by every head) and values [S, H, v_head_dim]: kv_b_proj."""
        c = self.config
        c_kv, k_pe = rows.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(-1, self.heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        return torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.heads, -1)], dim=-1), v

    def decompressed(self, x: torch.Tensor, rotary, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] packed whole sequences (cu_seqlens: [B + 1]) -> [T, hidden]: keys and
        values up-projected per head, then ordinary causal attention: the reference."""
        q, latent = self.to_heads(x, rotary)
        k, v = self.decompress(latent[:, 0])
        return self.from_heads(causal_attention_varlen(q, k, v, cu_seqlens, self.scale))

    def to_heads(self, x: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (q = [q_nope ; q_pe] [T, H, nope + rope], the step's latent rows
        [T, 1, rank + rope]): everything before attention, token by token."""
        q_nope, q_pe, c_kv, k_pe = self.project(x, rotary)
        return torch.cat([q_nope, q_pe], dim=-1), torch.cat([c_kv, k_pe], dim=-1)[:, None, :]

    def from_heads(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's per-head output [T, H, v_head_dim] -> [T, hidden]: o_proj."""
        return self.o_proj(out.to(self.o_proj.weight.dtype).flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, **kw):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, **kw)
        self.up_proj = nn.Linear(h, i, bias=False, **kw)
        self.down_proj = nn.Linear(i, h, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLALayer(nn.Module):
    def __init__(self, config: ModelConfig, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = MLAAttention(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = MLP(config, **kw)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        """attend(attention, normed x) -> attention's output: the one part a path chooses."""
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return self.after_attention_output(x)

    def after_attention_output(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention's output was added -> the layer's output."""
        return x + self.mlp(self.post_attention_layernorm(x))

    def before_attention(self, x: torch.Tensor, rotary):
        """The layer up to attention -> (q [T, H, nope + rope], latent rows, the residual x):
        token by token, so piecewise graphs capture it per token count."""
        return (*self.self_attn.to_heads(self.input_layernorm(x), rotary), x)

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention's per-head output [T, H, v_head_dim] and the residual -> the layer's
        output."""
        return self.after_attention_output(residual + self.self_attn.from_heads(out))


class MLAModel(nn.Module):
    """A dense DeepSeek-V2/V3-style decoder. ``forward`` runs the decompressed path over whole
    sequences; ``forward_paged`` runs one engine step over a paged latent cache, each sequence
    on its path (``labkit.engine.mla_prefill``): absorbed, or decompressed where it has at
    least ``decompress_min_tokens`` new tokens (None: never). Parameters are allocated, not
    initialised: load a state dict.

    The engine runs it through ``hidden_states`` and ``compute_logits``, as it runs LlamaModel:
    each layer hands the engine's attention function its query ``[q_nope ; q_pe]`` and the
    step's latent rows (``MLAAttention.to_heads``); the engine stores the rows in its latent
    cache and attends each sequence on its path (``mla_prefill.engine_latent_attention``)."""
    fused_ops = False  # the engine's fused Triton layer ops are the Llama layer's

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        if not config.is_mla:
            raise ValueError("MLAModel needs a multi-head latent attention config (kv_lora_rank "
                             "and the rest given); a Llama-style config builds LlamaModel")
        self.config = config
        self.decompress_min_tokens: int | None = DECOMPRESS_MIN_NEW_TOKENS
        kw = dict(device=device, dtype=model_dtype(config, dtype))
        self.model = nn.Module()  # transformers' nesting, so state dict names match
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.model.layers = nn.ModuleList(MLALayer(config, **kw)
                                          for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config.qk_rope_head_dim,
                                                       config.rope_theta, device),
                             persistent=False)

    @property
    def embed_tokens(self) -> torch.Tensor:
        """The embedding table: where the engine reads the model's device and dtype."""
        return self.model.embed_tokens.weight

    @property
    def attention_scale(self) -> float:
        return self.model.layers[0].self_attn.scale

    def attention_layer(self, layer: int) -> MLAAttention:
        return self.model.layers[layer].self_attn

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attention, *,
                      fused_ops: bool | None = None) -> torch.Tensor:
        """The engine's forward: input_ids, positions [T] -> final-normed hidden [T, hidden].
        ``attention(layer, q, latent, None, out=...)`` stores the layer's latent rows and fills
        ``out`` with the per-head output [T, H, v_head_dim], allocated here: its width is the
        values', not the query's. ``fused_ops`` is not used."""
        rotary = rope_cos_sin(positions, self.inv_freq)
        x = self.model.embed_tokens(input_ids)
        v_dim = self.config.v_head_dim

        def attend(i, attn, h):
            q, latent = attn.to_heads(h, rotary)
            out = q.new_empty(q.shape[0], q.shape[1], v_dim)
            return attn.from_heads(attention(i, q, latent, None, out=out))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, lambda attn, h: attend(i, attn, h))
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        limit = self.config.max_position_embeddings
        if positions.numel() and int(positions.max()) >= limit:
            raise ValueError(f"position {int(positions.max())} is past the model's context of "
                             f"{limit} tokens (max_position_embeddings); shorten the sequence")
        rotary = rope_cos_sin(positions, self.inv_freq)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, lambda attn, h: attend(i, attn, h, rotary))
        return self.lm_head(self.model.norm(x))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, L] -> logits [B, L, vocab], through the decompressed path."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        cu = torch.arange(0, (batch + 1) * length, length, device=input_ids.device)
        logits = self._run(input_ids.reshape(-1), positions,
                           lambda i, attn, h, rotary: attn.decompressed(h, rotary, cu))
        return logits.view(batch, length, -1)

    def latent_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """Zeros [num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
        w = self.lm_head.weight
        return torch.zeros(self.config.num_hidden_layers, num_blocks, block_size,
                           self.config.latent_size, dtype=w.dtype, device=w.device)

    @torch.inference_mode()
    def forward_paged(self, input_ids: torch.Tensor, latent_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, *, backend: str = "triton") -> torch.Tensor:
        """One step over the paged latent cache: input_ids [T] are the new tokens of each
        sequence (cu_seqlens_q: [B + 1]), the last of its seq_lens [B] tokens; their latents
        are written into latent_cache [num_layers, num_blocks, block_size, latent] at the
        blocks of block_tables [B, max_blocks], then each sequence attends on its path: with
        ``backend="triton"`` through labkit's kernels (``paged_mla_attention``,
        ``flash_attention``), with "reference" through the float64 definition and plain torch.
        -> logits [T, vocab]."""
        if backend not in ("triton", "reference"):
            raise ValueError(f"backend={backend!r}: forward_paged runs 'triton' (labkit's "
                             "kernels) or 'reference' (the definition)")
        if input_ids.shape != (int(cu_seqlens_q[-1]),):
            # else positions (from the lengths) and tokens disagree, and RoPE broadcasts them
            raise ValueError(f"input_ids has {tuple(input_ids.shape)} tokens but cu_seqlens_q "
                             f"{cu_seqlens_q.tolist()} says the step has "
                             f"{int(cu_seqlens_q[-1])} new ones: pass exactly each sequence's "
                             "new tokens, none past the end of its prompt")
        positions = step_positions(cu_seqlens_q, seq_lens)
        slots = slot_mapping(block_tables, cu_seqlens_q, positions, latent_cache.shape[2])
        rank = self.config.kv_lora_rank
        attention = latent_step_attention(
            self.attention_layer, lambda i: latent_cache[i],
            lambda i, rows: write_latents(latent_cache[i], slots, rows[:, :rank], rows[:, rank:]),
            BACKENDS[backend].mla, block_tables, cu_seqlens_q, seq_lens,
            max_query_len=int(cu_seqlens_q.diff().max()) if len(seq_lens) else 0,
            min_new_tokens=self.decompress_min_tokens, flash=backend == "triton")
        return self._run(input_ids, positions, lambda i, attn, h, rotary: attn.from_heads(
            attention(i, *attn.to_heads(h, rotary))))


def generate_greedy(model: MLAModel, prompt: list[int], max_new_tokens: int, *,
                    absorbed: bool = True, block_table: list[int] | None = None,
                    block_size: int = 16) -> list[int]:
    """``max_new_tokens`` greedy tokens after ``prompt``. absorbed: prefill the latent cache,
    then decode one token a step, both through ``forward_paged`` (``block_table``: the physical
    blocks the sequence uses, in order; default 0, 1, 2...). Otherwise recompute the whole
    sequence through ``forward`` each step: the reference."""
    device, tokens = model.lm_head.weight.device, list(prompt)
    if not absorbed:
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens], device=device))
            tokens.append(int(logits[0, -1].argmax()))
        return tokens[len(prompt):]
    needed = -(-(len(prompt) + max_new_tokens) // block_size)
    block_table = list(range(needed)) if block_table is None else block_table
    if len(block_table) < needed:
        raise ValueError(f"block_table has {len(block_table)} blocks; {len(prompt)} + "
                         f"{max_new_tokens} tokens need {needed} of {block_size}")
    cache = model.latent_cache(max(block_table) + 1, block_size)
    table = torch.tensor([block_table], dtype=torch.int32, device=device)
    new = tokens
    for _ in range(max_new_tokens):
        cu = torch.tensor([0, len(new)], dtype=torch.int32, device=device)
        lens = torch.tensor([len(tokens)], dtype=torch.int32, device=device)
        logits = model.forward_paged(torch.tensor(new, device=device), cache, table, cu, lens)
        new = [int(logits[-1].argmax())]
        tokens = tokens + new
    return tokens[len(prompt):]
