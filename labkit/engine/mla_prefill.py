"""MLA prefill by decompression: a step's rows split by kind, each kind on its faster path.

The absorbed path (``paged_mla_attention``) pays ``rank + rope`` for every (query, key) score
and ``rank`` for every value it sums: cheap for a decode row, which reads each cached latent row
once for all heads. The decompressed path up-projects each context row once per step with
``kv_b_proj`` into per-head keys (``nope + rope``) and values (``v_head_dim``), then runs
ordinary causal attention over them, far narrower per pair. The up-projection is paid once per
context row and the saving once per (query, key) pair, so a sequence with many new tokens wins
and a decode row loses. A step's sequences are therefore split:

- a sequence with at least ``DECOMPRESS_MIN_NEW_TOKENS`` new tokens (a prefill, or a long
  chunk of one) attends decompressed: its latent rows for its whole context, earlier chunks and
  prefix-cache hits included, are gathered from the paged cache and up-projected, and its new
  tokens attend to them causally, aligned to the end (new token i sits at position
  ``seq_len - len_q + i``);
- every other sequence (decode, verify tokens, short chunks) goes through the absorbed kernel.

The decompressed attention is labkit's ``flash_attention`` (``flash=True``; head dims padded to
the power of two it takes) or, where that cannot run, plain torch in float32.

The attention function ``latent_step_attention`` builds takes the layer's unfolded query
``[q_nope ; q_pe]`` and its step's latent rows, stores the rows, and returns the per-head output
``[T, H, v_head_dim]`` that ``o_proj`` takes: W_UK and W_UV are applied here, to the absorbed
rows only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The shortest prefill benchmarks/mla_prefill.py measures at DeepSeek-V3's shape: there, and at
# every longer length, the decompressed path was the faster. Below it the up-projection of the
# whole context is paid back by fewer queries, so shorter chunks stay on the absorbed kernel.
DECOMPRESS_MIN_NEW_TOKENS = 1024


def padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., d] zero-padded to ``width`` columns: zeros add nothing to a dot product, and the
    output's extra columns are dropped after."""
    return torch.nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


def causal_attention_varlen(q, k, v, cu_seqlens_q, scale, cu_seqlens_k=None):
    """q: [Tq, H, D], k: [Tk, H, D], v: [Tk, H, Dv] packed sequences -> [Tq, H, Dv] in float32.
    Causal and aligned to the end: query i of a sequence sits at ``len_k - len_q + i`` among
    its keys. ``cu_seqlens_k`` defaults to ``cu_seqlens_q`` (whole sequences)."""
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=torch.float32, device=q.device)
    bq, bk = cu_seqlens_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float()) * scale
        pos = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
        future = torch.arange(k1 - k0, device=q.device)[None, :] > pos
        probs = s.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v[k0:k1].float())
    return out


def decompressed_attention(attention, q, k, v, cu_seqlens_q, cu_seqlens_k, max_query_len: int,
                           *, flash: bool) -> torch.Tensor:
    """q [Tq, H, nope + rope] over decompressed k [Tk, H, nope + rope], v [Tk, H, v_head_dim]
    (``attention``: the layer's MLAAttention, for its scale) -> [Tq, H, v_head_dim], q's dtype."""
    if not flash:
        return causal_attention_varlen(q, k, v, cu_seqlens_q, attention.scale,
                                       cu_seqlens_k).to(q.dtype)
    from labkit.attention import flash_attention
    from labkit.kernels.grid import next_power_of_2
    width = next_power_of_2(max(q.shape[-1], v.shape[-1]))
    out = flash_attention(padded(q, width), padded(k, width), padded(v, width), cu_seqlens_q,
                          cu_seqlens_k, causal=True, scale=attention.scale, check=False,
                          max_seqlen_q=max_query_len)
    return out[..., :v.shape[-1]]


@dataclass(frozen=True)
class RowGroup:
    """Some of a step's sequences (``seqs``, indices into the step's sequences), the rows of
    their new tokens in the step (``rows``) and the group's own cu_seqlens_q [S + 1]. ``seqs``
    and ``rows`` are slices where they run unbroken, as they do when the scheduler puts decodes
    first and prefill chunks after: then picking a group's rows copies nothing."""
    seqs: slice | torch.Tensor
    rows: slice | torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int

    @classmethod
    def of(cls, seqs: list[int], cu_q: list[int], device) -> RowGroup:
        lens = [cu_q[s + 1] - cu_q[s] for s in seqs]
        rows = [r for s in seqs for r in range(cu_q[s], cu_q[s + 1])]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)

        def index(ids: list[int]):
            if ids == list(range(ids[0], ids[-1] + 1)):
                return slice(ids[0], ids[-1] + 1)
            return torch.tensor(ids, dtype=torch.long, device=device)
        return cls(index(seqs), index(rows), torch.tensor(cu, dtype=torch.int32, device=device),
                   max(lens))


def split_sequences(lens_q: list[int], min_new_tokens: int | None) -> tuple[list[int], list[int]]:
    """(absorbed, decompressed): the step's sequences by path, from each one's new tokens.
    Sequences with none are in neither; ``min_new_tokens=None`` sends every one absorbed."""
    long = [min_new_tokens is not None and n >= min_new_tokens for n in lens_q]
    return ([i for i, n in enumerate(lens_q) if n and not long[i]],
            [i for i, n in enumerate(lens_q) if n and long[i]])


def context_slots(block_tables: torch.Tensor, seqs: list[int], seq_lens: list[int],
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [sum of their seq_lens], cu_seqlens_k [S + 1]): where each of ``seqs``' whole
    context lies in the flattened paged cache, position 0 first."""
    dev = block_tables.device
    lens = torch.tensor([seq_lens[s] for s in seqs], dtype=torch.long, device=dev)
    seq = torch.tensor(seqs, dtype=torch.long, device=dev).repeat_interleave(lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), device=dev) - starts.repeat_interleave(lens)
    slots = block_tables.long()[seq, pos // block_size] * block_size + pos % block_size
    cu_k = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]).int()
    return slots, cu_k


def absorbed_attention(attention, mla, q, latent_cache, block_tables, cu_seqlens_q, seq_lens,
                       max_query_len: int) -> torch.Tensor:
    """q [T, H, nope + rope] through the absorbed path: W_UK folded in, ``mla`` (the kernel's
    signature) over the latent rows, W_UV after -> [T, H, v_head_dim]."""
    rank = attention.config.kv_lora_rank
    folded = attention.fold_query(q)
    out = mla(folded[..., :rank], folded[..., rank:], latent_cache, block_tables, cu_seqlens_q,
              seq_lens, scale=attention.scale, check=False, max_query_len=max_query_len)
    return attention.unfold_output(out)


def latent_step_attention(layers, latent_cache, store, mla, block_tables: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, *,
                          max_query_len: int, host_lengths: tuple[list, list] | None = None,
                          min_new_tokens: int | None = DECOMPRESS_MIN_NEW_TOKENS,
                          flash: bool = False):
    """A step's MLA attention function ``attention(layer, q, latent, v=None, out=None)``: q
    [T, H, nope + rope] unfolded and the step's latent rows [T, 1, rank + rope] in, the rows
    stored first, [T, H, v_head_dim] out (into ``out`` when given).

    ``layers(i)``: layer i's MLAAttention; ``latent_cache(i)``: its cache [num_blocks,
    block_size, rank + rope]; ``store(i, rows [T, rank + rope])`` writes the step's rows there;
    ``mla``: the absorbed kernel (``paged_mla_attention``'s signature). The split (module
    docstring) is planned once for the step: only if ``max_query_len`` reaches
    ``min_new_tokens`` (None: never) are the lengths looked at, from ``host_lengths`` (each
    sequence's new tokens, each one's seq_len) or else read back from the device once."""
    groups = None  # None: the whole step absorbed, on the metadata as it stands (graph-safe)
    if min_new_tokens is not None and max_query_len >= min_new_tokens:
        lens_q, lens_k = host_lengths or (cu_seqlens_q.diff().tolist(), seq_lens.tolist())
        absorbed, decompressed = split_sequences(lens_q, min_new_tokens)
        if decompressed:
            dev, cu_q = block_tables.device, [0]
            for n in lens_q:
                cu_q.append(cu_q[-1] + n)
            groups = [RowGroup.of(absorbed, cu_q, dev) if absorbed else None,
                      RowGroup.of(decompressed, cu_q, dev),
                      context_slots(block_tables, decompressed, lens_k, latent_cache(0).shape[1])]

    def attention(layer, q, latent, v=None, out=None):
        store(layer, latent[:, 0])
        attn, cache = layers(layer), latent_cache(layer)
        if groups is None:  # a decode step: the result is the output, copied only into a given one
            result = absorbed_attention(attn, mla, q, cache, block_tables, cu_seqlens_q,
                                        seq_lens, max_query_len)
            return result if out is None else out.copy_(result)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], attn.config.v_head_dim)
        absorbed, decompressed, (slots, cu_k) = groups
        if absorbed is not None:
            rows, seqs = absorbed.rows, absorbed.seqs
            out[rows] = absorbed_attention(
                attn, mla, q[rows], cache, block_tables[seqs], absorbed.cu_seqlens_q,
                seq_lens[seqs], absorbed.max_query_len)
        k, v = attn.decompress(cache.reshape(-1, cache.shape[-1]).index_select(0, slots))
        out[decompressed.rows] = decompressed_attention(
            attn, q[decompressed.rows], k, v, decompressed.cu_seqlens_q, cu_k,
            decompressed.max_query_len, flash=flash)
        return out
    return attention


def engine_latent_attention(runner, md, max_query_len: int, *, store: bool = True, host=None):
    """The engine runner's MLA attention function for a step (``StepAttention``): ``md`` its
    device metadata, ``host`` its host metadata. With no host metadata (a full CUDA graph's
    capture: decode or verify rows, and no length may be read back) every row is absorbed.
    ``store=False`` when piecewise graphs stored the latent rows already. Decompressed rows run
    ``flash_attention`` on a GPU and wherever the triton backend was chosen (its interpreter on
    CPU), plain torch otherwise."""
    cache, model = runner.cache, runner.model

    def write(layer, rows):
        if store:  # slots from the block manager, in range by construction: no check, no sync
            cache.write_latent(layer, rows, md.slot_mapping, use_kernel=runner.store_kernel,
                               check=False)
    lengths = None if host is None else (
        [b - a for a, b in zip(host.cu_seqlens_q[:-1], host.cu_seqlens_q[1:])],
        list(host.seq_lens))
    return latent_step_attention(
        model.attention_layer, cache.latent_cache, write, runner.backend.mla, md.block_tables,
        md.cu_seqlens_q, md.seq_lens, max_query_len=max_query_len, host_lengths=lengths,
        min_new_tokens=None if host is None else model.decompress_min_tokens,
        flash=runner.device.type == "cuda" or runner.backend.name == "triton")
