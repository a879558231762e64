"""What notebook 06 claims from the IO arithmetic of tiling (``compare.tile_io`` and
``compare.attention_io``): the same numbers on every machine, each with a condition that fails
when the arithmetic stops favouring the tiled kernel."""
from __future__ import annotations

import itertools

import pandas as pd

from labkit.teaching import claim


def tiling_claims(tiles: pd.DataFrame, io: dict, length: int) -> list:
    """The tile arithmetic: more queries per K/V tile, more FLOPs per streamed byte; tiling moves
    fewer HBM bytes than writing the scores."""
    per = tiles.set_index(["BLOCK_M", "BLOCK_N"]).flops_per_byte
    small, large = per[(64, 64)], per[(128, 64)]
    return [
        claim("A 128-query tile does {large:.0f} FLOPs per byte of K/V it streams, a 64-query "
              "tile {small:.0f}: the intensity grows with the queries that share each tile.",
              bool(large > small), large=large, small=small),
        claim("At {n:,} tokens, 32 heads, head_dim 128, tiled attention moves {tiled:,.0f} MiB "
              "through HBM against {naive:,.0f} MiB with the scores written and read back "
              "({x:.0f}x fewer bytes).", io["tiled_bytes"] < io["naive_bytes"], n=length,
              tiled=io["tiled_bytes"] / 2**20, naive=io["naive_bytes"] / 2**20,
              x=io["naive_bytes"] / io["tiled_bytes"]),
    ]


def causal_memory_claims(ios: dict[int, dict]) -> list:
    """``ios``: ``attention_io`` per sequence length (prefill, len_q == len_k). With the causal
    mask the key loop stops at the diagonal: the fraction of K/V bytes and FLOPs left tends to
    one half as S grows. Without a score matrix in HBM, the footprint grows linearly in S."""
    lengths = sorted(ios)
    frac = {n: (ios[n]["causal_tiled_bytes"] / ios[n]["tiled_bytes"],
                ios[n]["causal_flops_computed"] / ios[n]["tiled_flops_computed"])
            for n in lengths}
    short, long_ = lengths[0], lengths[-1]
    shrinking = all(frac[a][i] >= frac[b][i] for a, b in itertools.pairwise(lengths)
                    for i in (0, 1))
    a, b = lengths[-2], lengths[-1]
    tiled_growth = ios[b]["tiled_memory_bytes"] / ios[a]["tiled_memory_bytes"]
    naive_growth = ios[b]["naive_memory_bytes"] / ios[a]["naive_memory_bytes"]
    length_growth = b / a
    return [
        claim("Causal prefill at {n:,} tokens: the kernel's key loop stops at the diagonal, so it "
              "reads {bytes_:.3f} of the tiled loop's K/V bytes and computes {flops:.3f} of its "
              "FLOPs; at {n0:,} tokens {bytes0:.3f} and {flops0:.3f}. The fraction falls with "
              "the length toward one half.",
              shrinking and 0.5 <= frac[long_][1] <= frac[long_][0] < 0.55, n=long_,
              bytes_=frac[long_][0], flops=frac[long_][1], n0=short, bytes0=frac[short][0],
              flops0=frac[short][1]),
        claim("The tiled kernel never materialises the scores: from {a:,} to {b:,} tokens "
              "({g:.0f}x the length) the HBM a call holds grows {tiled:.2f}x (Q, K, V, O: linear "
              "in S), the naive one's {naive:.2f}x (the [S, S] scores: quadratic); at {b:,} "
              "tokens {naive_mib:,.0f} MiB against {tiled_mib:,.0f} MiB.",
              tiled_growth <= length_growth * (1 + 1e-9) and naive_growth > 0.9 * length_growth**2,
              a=a, b=b, g=length_growth, tiled=tiled_growth, naive=naive_growth,
              naive_mib=ios[b]["naive_memory_bytes"] / 2**20,
              tiled_mib=ios[b]["tiled_memory_bytes"] / 2**20),
    ]
