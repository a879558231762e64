"""What notebook 06 claims about backend selection and correctness, from the decisions and
checks just run on this machine."""
from __future__ import annotations

import math

from labkit.attention import BACKENDS
from labkit.teaching import claim

MLA_SERVERS = {b.name for b in BACKENDS.values() if b.mla is not None}


def mla_claims(spec, cache: dict) -> list:
    """The MLA example as selection sees it: one latent "KV head" shared by every query head,
    and its cache bytes per token (``compare.mla_cache_bytes``) against per-head K and V."""
    return [claim(
        "DeepSeek-V3's MLA spec caches {kv} latent of width {w} per token and layer, read by all "
        "{hq} query heads: {mla:,} bytes in bf16, against {per:,} bytes for per-head K and V of "
        "the same heads ({x:.0f}x less).",
        spec.num_kv_heads == 1 and 2 * spec.head_dim == cache["mla_bytes"] and cache["ratio"] > 1,
        kv=spec.num_kv_heads, w=spec.head_dim, hq=spec.num_q_heads, mla=cache["mla_bytes"],
        per=cache["per_head_bytes"], x=cache["ratio"])]


def selection_claims(chosen: dict, refused: dict) -> list:
    """Who serves the awkward shapes, from the selection just run (``chosen``: name -> (backend,
    passed over); ``refused``: name -> reasons per backend)."""
    fp8_a100 = chosen.get("GQA + fp8 KV cache on an A100", ("nothing",))[0]
    hd96 = chosen.get("head_dim 96 (Phi-3-mini-like)", ("nothing",))[0]
    # MLA: served by a backend with an MLA call (paged_mla_attention); the others must say why
    mla = {n: c for n, c in chosen.items() if "MLA" in n}
    served = sorted({backend for backend, _ in mla.values()})
    refusing = sorted({b for _, passed in mla.values() for b in passed
                       if b not in MLA_SERVERS})
    mla_reasoned = bool(mla) and set(served) <= MLA_SERVERS and all(
        any("MLA" in why for why in passed.get(b, ())) for _, passed in mla.values()
        for b in refusing) and bool(refusing)
    return [
        claim("An fp8 KV cache on an A100 (compute capability 8.0) is served by `{b}`: every "
              "faster backend refused it, and the log says why.", fp8_a100 == "reference",
              b=fp8_a100),
        claim("head_dim 96 is served by `{b}`: labkit's Triton kernels refuse it.",
              hd96 not in ("triton", "nothing"), b=hd96),
        claim("MLA is served by `{b}` through its latent-cache kernel; {names} refused it, "
              "each naming MLA among its reasons.", mla_reasoned,
              b=", ".join(served) or "nothing", names=", ".join(refusing) or "none"),
    ]


def correctness_claim(checks: dict, device: str) -> list:
    """Every compatible backend against the float64 reference, on the cases just run."""
    tables = list(checks.values())
    compared = sum(int(t.compatible.sum()) for t in tables)
    passed = all(bool(t.passed[t.compatible].all()) for t in tables)
    worst = max((float(t.relative_error.max()) for t in tables if t.compatible.any()),
                default=math.nan)
    return [claim("On {device}, {n} backend runs over {cases} cases matched the float64 "
                  "reference within their dtype's tolerance; the largest relative error was "
                  "{worst:.1e}.", passed and compared > 0, device=device, n=compared,
                  cases=len(tables), worst=worst)]
