"""The two PyTorch peers, SDPA and FlexAttention, as engines run them: one batched call a layer.

Not a loop over sequences: the queries are padded to ``[B, Hq, Lq, D]`` and the keys gathered,
in one indexing op, from the paged cache (or the packed tensor) into ``[B, Hkv, Lk, D]``;
:class:`PaddedBatch` says which key slots each query sees. Those shapes are sized on the host,
from the batch's lengths: an engine passes the lengths its step metadata already holds on the
host (``host_lengths``), so no layer waits for the device; a call without them reads them back
once (one sync a call, so one a layer). Each peer exposes the two calls of
``labkit.attention`` (``flash`` over packed K/V, ``paged`` over a block-table cache);
``backends.py`` declares what they support.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# --- the padded batch that sdpa and flex run on ------------------------------------------------

@dataclass(frozen=True)
class PaddedBatch:
    """A varlen step as one padded batch, from its lengths on the host.

    Query row ``i`` of sequence ``b`` sits at position ``lens_k[b] - lens_q[b] + i`` (the
    causal mask is end-aligned, as in ``reference``). Key slot ``j`` holds key position
    ``j + offset[b]``: offset 0 (left-aligned), except at decode (every ``lens_q`` is 1),
    where the keys are right-aligned so that a window gathers only its last ``window`` keys.
    """
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    causal: bool
    window: int | None

    @property
    def decode(self) -> bool:
        """Every sequence brings one new token: a uniform single-token decode batch."""
        return bool(self.lens_q) and all(n == 1 for n in self.lens_q)

    @property
    def q_width(self) -> int:
        return max(self.lens_q, default=0)

    @property
    def k_width(self) -> int:
        longest = max(self.lens_k, default=0)
        return min(longest, self.window) if self.decode and self.window else longest

    @property
    def empty(self) -> bool:
        return self.q_width == 0 or self.k_width == 0

    @property
    def needs_mask(self) -> bool:
        """False where SDPA needs no mask: each query sees every key slot it is given (decode
        with no padding), or the lengths are equal and SDPA's own causal flag is right."""
        if self.decode:  # a single query sees all its keys: only padding needs a mask
            return min(self.lens_k) < self.k_width
        if len(set(self.lens_q)) > 1 or len(set(self.lens_k)) > 1:
            return True
        len_q, len_k = self.lens_q[0], self.lens_k[0]
        if self.window is not None and self.window < len_k:
            return True
        return self.causal and len_q != len_k  # SDPA's is_causal aligns top-left

    @property
    def is_causal(self) -> bool:
        """Unmasked and causal over square sequences: SDPA's is_causal=True is the mask."""
        return not self.needs_mask and self.causal and not self.decode

    def offsets(self, lens_k: torch.Tensor) -> torch.Tensor:
        """[B] int64: the key position held in slot 0 of each sequence."""
        lens_k = lens_k.to(torch.int64)
        return lens_k - self.k_width if self.decode else torch.zeros_like(lens_k)

    def key_positions(self, lens_k: torch.Tensor) -> torch.Tensor:
        """[B, k_width] int64 key positions to gather, clamped into each sequence (the slots
        past its end read its own last key, which the mask then hides)."""
        lens_k = lens_k.to(torch.int64)
        pos = torch.arange(self.k_width, device=lens_k.device) + self.offsets(lens_k)[:, None]
        return pos.clamp(min=0).minimum((lens_k - 1).clamp(min=0)[:, None])


def visibility(lens_q: torch.Tensor, lens_k: torch.Tensor, offsets: torch.Tensor, *,
               causal: bool, window: int | None):
    """mask_mod(b, h, q_idx, kv_idx) -> bool: does query row q_idx of sequence b see key slot
    kv_idx. A FlexAttention mask_mod as it stands; called on broadcast aranges it is SDPA's
    dense mask. It closes over tensors and the two flags only, so a new batch with the same
    flags does not recompile a compiled flex_attention."""
    def mask_mod(b, h, q_idx, kv_idx):
        len_q, len_k = lens_q[b], lens_k[b]
        key, query = kv_idx + offsets[b], q_idx + len_k - len_q
        ok = (q_idx < len_q) & (key >= 0) & (key < len_k)
        if causal:
            ok = ok & (key <= query)
        if window is not None:
            ok = ok & (key > query - window)
        return ok
    return mask_mod


def sees_a_key(batch: PaddedBatch, lens_q: torch.Tensor, lens_k: torch.Tensor) -> torch.Tensor:
    """[B, q_width] bool: query rows that see at least one key (the rest return zeros)."""
    lens_q, lens_k = lens_q.to(torch.int64)[:, None], lens_k.to(torch.int64)[:, None]
    i = torch.arange(batch.q_width, device=lens_q.device)[None, :]
    query = i + lens_k - lens_q
    hi = torch.minimum(lens_k, query + 1) if batch.causal else lens_k.expand_as(query)
    lo = (query - batch.window + 1).clamp(min=0) if batch.window else torch.zeros_like(query)
    return (i < lens_q) & (hi > lo)


def _host_lengths(lens_q: torch.Tensor, lens_k: torch.Tensor, given=None) -> tuple[tuple, tuple]:
    """Both length vectors on the host: the padded shapes depend on them. ``given`` (new tokens
    and keys per sequence, already on the host) costs nothing; otherwise ONE transfer, a sync."""
    if lens_q.numel() != lens_k.numel():
        raise ValueError(f"cu_seqlens_q describes {lens_q.numel()} sequences but the key "
                         f"lengths {lens_k.numel()}; pass one entry per sequence to both")
    if given is not None:
        host_q, host_k = (tuple(int(n) for n in lens) for lens in given)
        if len(host_q) != lens_q.numel() or len(host_k) != lens_k.numel():
            raise ValueError(f"host_lengths holds {len(host_q)} query and {len(host_k)} key "
                             f"lengths for a batch of {lens_q.numel()} sequences; pass one of "
                             "each per sequence, the same as the device tensors hold")
        return host_q, host_k
    both = torch.cat([lens_q.reshape(-1), lens_k.reshape(-1)]).tolist()
    n = lens_q.numel()
    return tuple(both[:n]), tuple(both[n:])


def _pad_queries(q, cu_seqlens_q, lens_q, batch: PaddedBatch):
    """q [total_q, Hq, D] -> [B, Hq, q_width, D] and the (sequence, row) of every packed token."""
    num_seqs = len(batch.lens_q)
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), lens_q.long(),
                                  output_size=q.shape[0])
    row = torch.arange(q.shape[0], device=q.device) - cu_seqlens_q.long()[seq]
    padded = q.new_zeros(num_seqs, batch.q_width, *q.shape[1:])
    padded[seq, row] = q
    return padded.transpose(1, 2), (seq, row)


def _read_paged(k_cache, v_cache, block_tables, dtype):
    """Key positions [B, L] -> K, V [B, Hkv, L, D]: one gather through the block tables."""
    block_size = k_cache.shape[1]

    def read(pos):
        col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
        blocks = block_tables.long().gather(1, col).clamp(0, k_cache.shape[0] - 1)
        rows = pos % block_size
        return (k_cache[blocks, rows].to(dtype).transpose(1, 2),
                v_cache[blocks, rows].to(dtype).transpose(1, 2))
    return read


def _read_packed(k, v, cu_seqlens_k):
    """Key positions [B, L] -> K, V [B, Hkv, L, D] from packed [total_k, Hkv, D]."""
    def read(pos):
        rows = (cu_seqlens_k[:-1].long()[:, None] + pos).clamp(0, max(k.shape[0] - 1, 0))
        return k[rows].transpose(1, 2), v[rows].transpose(1, 2)
    return read


# --- sdpa: PyTorch's scaled_dot_product_attention, one call per layer --------------------------

def sdpa_call(batch: PaddedBatch) -> str:
    """Which SDPA call the wrapper makes for this batch (what rules the kernels in or out)."""
    if batch.empty:
        return "none: no query sees a key (zeros)"
    if batch.decode and not batch.needs_mask:
        return "decode: enable_gqa, no mask (the flash kernel may serve it)"
    if batch.decode:
        return ("decode with padding: query heads folded onto their KV head, one boolean "
                "padding mask (no GQA flag needed; rules out the flash kernel)")
    if not batch.needs_mask:
        return f"equal lengths: enable_gqa, is_causal={batch.is_causal}, no mask"
    return "varlen: enable_gqa, one boolean mask (causal + window + padding)"


def _sdpa(q, cu_seqlens_q, lens_q, lens_k, read, *, causal, window, scale, host_lengths):
    batch = PaddedBatch(*_host_lengths(lens_q, lens_k, host_lengths), bool(causal), window)
    if batch.empty:
        return torch.zeros_like(q)
    k, v = read(batch.key_positions(lens_k))  # [B, Hkv, Lk, D]
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_q_heads != num_kv_heads
    mask_mod = visibility(lens_q, lens_k, batch.offsets(lens_k), causal=causal, window=window)
    if batch.decode:
        if not batch.needs_mask:  # equal lengths: one query sees all its keys, no mask at all
            out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale,
                                                 enable_gqa=gqa)
            return out.squeeze(2).contiguous()
        # A mask with enable_gqa leaves SDPA few kernels; at q_len 1 the query heads of one KV
        # head share its mask row, so they become that head's queries: [B, Hkv, group, D].
        seqs = torch.arange(len(batch.lens_q), device=q.device)[:, None]
        mask = mask_mod(seqs, None, 0, torch.arange(batch.k_width, device=q.device)[None, :])
        grouped = q.reshape(q.shape[0], num_kv_heads, num_q_heads // num_kv_heads, -1)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask[:, None, None],
                                             scale=scale)
        out = out.where(mask.any(-1)[:, None, None, None], 0.0)  # sees nothing: zeros
        return out.flatten(1, 2)
    q4, (seq, row) = _pad_queries(q, cu_seqlens_q, lens_q, batch)
    if batch.needs_mask:
        dev = q.device
        mask = mask_mod(torch.arange(len(batch.lens_q), device=dev)[:, None, None], None,
                        torch.arange(batch.q_width, device=dev)[None, :, None],
                        torch.arange(batch.k_width, device=dev)[None, None, :])
        out = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=gqa)
        out = out.where(mask.any(-1)[:, None, :, None], 0.0)
    else:
        out = F.scaled_dot_product_attention(q4, k, v, is_causal=batch.is_causal, scale=scale,
                                             enable_gqa=gqa)
    return out.transpose(1, 2)[seq, row]


def _entry_points(run, name: str):
    """The two calls of ``labkit.attention`` over one padded-batch implementation ``run``:
    ``flash`` reads packed K/V, ``paged`` a block-table cache (no fp8: the gather does not
    dequantise). ``host_lengths=(new tokens, keys)`` per sequence, as host ints equal to what
    the device tensors hold: an engine takes them from its step metadata once a step, and
    then no layer's call syncs."""
    def flash(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, window=None, scale=None,
              host_lengths=None):
        return run(q, cu_seqlens_q, cu_seqlens_q.diff(), cu_seqlens_k.diff(),
                   _read_packed(k, v, cu_seqlens_k), causal=causal, window=window, scale=scale,
                   host_lengths=host_lengths)

    def paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, causal=True,
              window=None, scale=None, k_scale=None, v_scale=None, host_lengths=None):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"the {name} backend has no fp8 cache support")
        return run(q, cu_seqlens_q, cu_seqlens_q.diff(), seq_lens,
                   _read_paged(k_cache, v_cache, block_tables, q.dtype), causal=causal,
                   window=window, scale=scale, host_lengths=host_lengths)

    flash.__name__, paged.__name__ = f"{name}_flash", f"{name}_paged"
    return flash, paged


sdpa_flash, sdpa_paged = _entry_points(_sdpa, "sdpa")


# --- flex: FlexAttention over the same padded batch, a block mask per batch shape -------------

_compiled_flex = {}  # device type -> flex_attention, compiled once on a GPU
FLEX_MASK_CACHE = 32  # block masks kept: one step's layers share one; a repeated batch reuses it
_block_masks: OrderedDict = OrderedDict()


def flex_attention_for(device: torch.device):
    """flex_attention as this wrapper calls it on ``device``."""
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention  # eager: unfused, but the same semantics
    if "cuda" not in _compiled_flex:
        # dynamic=True: batch, query and key lengths are symbols, so a new step's lengths reuse
        # the compiled kernel instead of recompiling until Dynamo's limit.
        _compiled_flex["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex["cuda"]


def flex_block_mask(batch: PaddedBatch, lens_q: torch.Tensor, lens_k: torch.Tensor):
    """The BlockMask of ``batch``, built once per batch shape (lengths, flags, device) and kept
    in a small LRU: every layer of one engine step asks for the same one."""
    from torch.nn.attention.flex_attention import create_block_mask
    key = (str(lens_q.device), batch)
    if key in _block_masks:
        _block_masks.move_to_end(key)
        return _block_masks[key]
    # Own copies: a caller may refill its length buffers, and the cached mask_mod reads these.
    lens_q, lens_k = (t.to(torch.int64, copy=True) for t in (lens_q, lens_k))
    mask_mod = visibility(lens_q, lens_k, batch.offsets(lens_k), causal=batch.causal,
                          window=batch.window)
    mask = create_block_mask(mask_mod, len(batch.lens_q), None, batch.q_width, batch.k_width,
                             device=lens_q.device)
    _block_masks[key] = mask
    while len(_block_masks) > FLEX_MASK_CACHE:
        _block_masks.popitem(last=False)
    return mask


def _flex(q, cu_seqlens_q, lens_q, lens_k, read, *, causal, window, scale, host_lengths):
    batch = PaddedBatch(*_host_lengths(lens_q, lens_k, host_lengths), bool(causal), window)
    if batch.empty:
        return torch.zeros_like(q)
    k, v = read(batch.key_positions(lens_k))
    if batch.decode:
        q4, unpad = q.unsqueeze(2), None
    else:
        q4, unpad = _pad_queries(q, cu_seqlens_q, lens_q, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile" on CPU: known, fine
        out = flex_attention_for(q.device)(q4, k, v, scale=scale,
                                           block_mask=flex_block_mask(batch, lens_q, lens_k),
                                           enable_gqa=q.shape[1] != k.shape[1])
    out = out.where(sees_a_key(batch, lens_q, lens_k)[:, None, :, None], 0.0)
    return out.squeeze(2).contiguous() if unpad is None else out.transpose(1, 2)[unpad]


flex_flash, flex_paged = _entry_points(_flex, "flex")


