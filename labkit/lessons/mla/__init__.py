"""Notebook 10: multi-head latent attention (MLA) from the cache's bytes to the engine.

Four questions, each answered from values computed here:
1. What does a token cost in the cache under MHA, GQA, MQA and MLA at a real model's shape, and
   how many requests fit in a fixed amount of memory? (``scheme_table``)
2. Why may decode attend over the latent itself? Absorbing ``W_UK`` into the query and ``W_UV``
   into the output is associativity, checked on a real layer's weights (``absorption_check``),
   and what it saves per decode step (``decode_step_flops``).
3. What does that make of a decode kernel? One shared 576-wide row per token read by every head:
   FLOPs per cached byte grow with the heads (``decode_intensity``), so with enough heads MLA
   decode leaves the bandwidth roof for the compute roof.
4. Measured: ``paged_mla_attention`` replayed from CUDA Graphs at DeepSeek-V3's widths against the
   copy bandwidth and a bf16 matmul timed in the same rounds (``measure_decode``, also
   ``benchmarks/mla_decode.py`` and the ``mla/decode`` recording).
"""
from labkit.lessons.mla.absorption import absorption_check, absorption_claims, decode_step_flops
from labkit.lessons.mla.cache_bytes import (bytes_claims, counted_flops_claim, decode_intensity,
                                            intensity_claim, intensity_figure, mla_flops,
                                            per_byte_claim, roof_us, scheme_table)
from labkit.lessons.mla.decode import (decode_claims, decode_inputs, decode_table, gqa_decode,
                                       latent_decode, live_decode, measure_decode, rate,
                                       replayed, roofline_figure, roofs, timed)
from labkit.lessons.mla.kernel import (kernel_check, kernel_claim, kernel_loop_source,
                                       prefill_flops, prefill_paths)
from labkit.lessons.mla.serving import engine_claim, engine_tokens, tiny_mla_config
from labkit.lessons.mla.shapes import BLOCK, RANK, ROPE, SCALE
from labkit.lessons.paged_kv_cache.attention_memory import DEEPSEEK_V3

__all__ = [
    "BLOCK", "DEEPSEEK_V3", "RANK", "ROPE", "SCALE", "absorption_check", "absorption_claims",
    "bytes_claims", "counted_flops_claim", "decode_claims", "decode_inputs", "decode_intensity",
    "decode_step_flops", "decode_table", "engine_claim", "engine_tokens", "gqa_decode",
    "intensity_claim", "intensity_figure", "kernel_check", "kernel_claim", "kernel_loop_source",
    "latent_decode", "live_decode", "measure_decode", "mla_flops", "per_byte_claim",
    "prefill_flops", "prefill_paths", "rate", "replayed", "roof_us", "roofline_figure", "roofs",
    "scheme_table", "timed", "tiny_mla_config",
]
