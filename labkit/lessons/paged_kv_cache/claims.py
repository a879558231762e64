"""The sentences notebook 05 states from its measurements, each a :func:`claim` whose condition
a test perturbs (schemes swapped, caching on and off swapped, pools reversed, the two TTFT
timings or the two fp8 scales swapped) to see it fail."""
from __future__ import annotations

import pandas as pd

from labkit.kernels.store_kv import FP8_E4M3_MAX
from labkit.lessons.paged_kv_cache.prefix_ttft import CACHED, UNCACHED, PrefixTTFT
from labkit.teaching import claim


def memory_claims(memory: pd.DataFrame, by_block: pd.DataFrame, block_size: int) -> list:
    """Paged against contiguous in the same memory, and what the block size costs, computed
    from :func:`.memory.compare_memory` and :func:`.memory.utilisation_by_block_size`."""
    contiguous = memory[memory.scheme == "contiguous"].set_index("capacity_tokens")
    paged = memory[memory.scheme != "contiguous"].set_index("capacity_tokens")
    gain = paged.requests_fit / contiguous.requests_fit
    blocks = by_block[by_block.scheme != "contiguous"]
    used = pd.Series(blocks.utilisation.values,
                     index=[int(name.split()[-1].rstrip(")")) for name in blocks.scheme])
    return [
        claim("The same memory holds {lo:.1f}x to {hi:.1f}x as many requests when they take "
              "blocks as they grow as when each reserves the worst case up front.",
              bool((gain >= 2).all()), lo=float(gain.min()), hi=float(gain.max())),
        claim("Paged, {p:.0%} of the reserved slots hold a token (the worst of the capacities "
              "tried); reserving max_model_len per request, {c:.0%}.",
              bool((paged.utilisation > 0.9).all() and (contiguous.utilisation < 0.5).all()),
              p=float(paged.utilisation.min()), c=float(contiguous.utilisation.max())),
        claim("Blocks of {b} tokens fill {small:.1%} of their slots, blocks of {big} only "
              "{large:.1%}: the last, partly filled block of each request wastes more the bigger "
              "the block.", bool(used.loc[block_size] > used.iloc[-1]), b=block_size,
              small=float(used.loc[block_size]), big=int(used.index[-1]),
              large=float(used.iloc[-1])),
    ]


def copy_on_write_claim(copies, reads_parent: bool):
    return claim("The forked request's append into the shared block was served by copy-on-write "
                 "{copies}, and it still reads its parent's prefix through its own block table.",
                 bool(copies) and bool(reads_parent), copies=list(copies))


def prefix_claims(on: dict, off: dict, pressure: pd.DataFrame) -> list:
    """Prefix caching on the chat workload (:func:`.prefix_workload.run_prefix_workload`,
    caching on and off) and as the pool shrinks."""
    by_pool = pressure.sort_values("num_blocks")
    small, large = by_pool.iloc[0], by_pool.iloc[-1]
    return [
        claim("With prefix caching, {hit:.0%} of the prompt blocks were found in the cache, and "
              "prefill computed {on_t:,} of the {off_t:,} tokens it computes without caching "
              "({share:.0%}).", on["hit_rate"] > 0.5 and off["hit_rate"] == 0
              and on["prefill_tokens_computed"] < 0.5 * off["prefill_tokens_computed"],
              hit=on["hit_rate"], on_t=on["prefill_tokens_computed"],
              off_t=off["prefill_tokens_computed"],
              share=on["prefill_tokens_computed"] / off["prefill_tokens_computed"]),
        claim("Shrinking the pool from {big:,} to {few:,} blocks lowers the hit rate from "
              "{hit_big:.0%} to {hit_few:.0%} and raises evictions from {ev_big:,} to {ev_few:,}: "
              "running requests crowd the cached blocks out.",
              bool(large.hit_rate > small.hit_rate and small.evictions > large.evictions),
              big=int(large.num_blocks), few=int(small.num_blocks), hit_big=float(large.hit_rate),
              hit_few=float(small.hit_rate), ev_big=int(large.evictions),
              ev_few=int(small.evictions)),
    ]


def prefix_ttft_claim(result: PrefixTTFT, bound: float = 2.0):
    """:func:`.prefix_ttft.time_prefix_ttft`'s rounds: caching on must be ``bound`` times sooner
    to the first token in every round, with the whole system prompt's full blocks hit."""
    on, off, gain = result.ttft_ms(CACHED), result.ttft_ms(UNCACHED), result.speedup()
    shared = result.system_prompt_len - result.system_prompt_len % result.block_size
    hit, hit_off = result.cached_tokens[CACHED], result.cached_tokens[UNCACHED]
    return claim(
        "Bursts of {burst} requests behind one shared {system:,}-token system prompt ({model}): "
        "with prefix caching each request found {hit:,} of its {prompt:,} prompt tokens in the "
        "cache and its first token came after {on:.1f} ms (range over rounds {on_lo:.1f}-"
        "{on_hi:.1f}), against {off:.1f} ms ({off_lo:.1f}-{off_hi:.1f}) with caching off: "
        "{gain:.2fx} sooner, and above {bound:g}x in every interleaved round.",
        gain.above(bound) and hit == shared and hit_off == 0,
        burst=result.burst, system=result.system_prompt_len, model=result.model, hit=hit,
        prompt=result.prompt_len, on=on.median, on_lo=on.low, on_hi=on.high, off=off.median,
        off_lo=off.low, off_hi=off.high, gain=gain, bound=bound)


def fp8_granularity_claim(table: pd.DataFrame, near: float = 1e-3, bound: float = 3.0):
    """:func:`.fp8_scales.scale_granularity`'s table: per-head error the same on every head; one
    per-tensor scale as good on heads within ``1 / near`` of the largest, and more than
    ``bound`` times worse on the smallest head, whose values it stores below e4m3's smallest
    normal number."""
    close = table[table["amax / largest"] >= near]
    smallest = table.loc[table["amax / largest"].idxmin()]
    per_head = table["error, per-head scale"]
    worst_close = float(close["error, per-tensor scale"].max())
    stored = float(smallest["amax / largest"]) * FP8_E4M3_MAX  # its amax / the shared scale
    return claim(
        "In e4m3, per-head scales gave every head {head_lo:.1%}-{head_hi:.1%} relative error. "
        "One per-tensor scale did as well ({close:.1%} at worst) on the heads within "
        "{span:,.0f}x of the largest, but the smallest head, {far:,.0f}x below it, had "
        "{far_err:.1%} ({far_head:.1%} with its own scale): the shared scale stored its largest "
        "value as {stored:.2g}, under e4m3's smallest normal number (2^-6), where the "
        "subnormals keep fewer significant bits.",
        bool(worst_close < 1.25 * per_head.max() and stored < 2**-6
             and smallest["error, per-tensor scale"] > bound * smallest["error, per-head scale"]),
        head_lo=float(per_head.min()), head_hi=float(per_head.max()), close=worst_close,
        span=1 / float(close["amax / largest"].min()), far=1 / float(smallest["amax / largest"]),
        far_err=float(smallest["error, per-tensor scale"]),
        far_head=float(smallest["error, per-head scale"]), stored=stored)


def stale_scale_claim(table: pd.DataFrame, bound: float = 3.0):
    """:func:`.fp8_scales.stale_scale`'s rows, in its order (in range, stale, on the fly): the
    stale scale clips and its error is more than ``bound`` times the on-the-fly scale's."""
    in_range, stale, fly = (table.iloc[i] for i in range(3))
    return claim(
        "A scale calibrated as amax / 448 kept new tokens from the same distribution at "
        "{ok:.1%} error; when the live values grew past the calibration data ({stale_name}), "
        "{clipped:.1%} of them clipped at 448 x scale and the error rose to {stale:.1%}, against "
        "{fly:.1%} with the scale computed on the fly from the tokens being written.",
        bool(stale["clipped share"] > 0.01 and fly["clipped share"] == 0
             and stale["relative error"] > bound * fly["relative error"]),
        ok=float(in_range["relative error"]), stale_name=stale["scale"],
        clipped=float(stale["clipped share"]), stale=float(stale["relative error"]),
        fly=float(fly["relative error"]))
