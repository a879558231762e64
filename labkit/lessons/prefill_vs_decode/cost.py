"""What one forward costs, from its shapes alone: the FLOPs and bytes of a prefill or a decode
step, its arithmetic intensity, and the decode batch at which it would reach a machine's ridge.
``forward`` times the real forward of the same shapes."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from labkit import check_positive_int
from labkit.engine.config import ModelConfig

KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class ForwardShape:
    """``batch`` sequences of ``tokens`` new tokens each, the last over ``context`` KV tokens."""
    kind: str
    batch: int
    tokens: int
    context: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("batch", "tokens", "context"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                value = int(value)  # a NumPy int from a table is fine
            object.__setattr__(self, name, check_positive_int(name, value))
        if self.context < self.tokens:
            raise ValueError(f"context ({self.context}) must hold the {self.tokens} new tokens")

    @property
    def name(self) -> str:
        return (f"prefill S={self.tokens}" + (f" x{self.batch}" if self.batch > 1 else "")
                if self.kind == "prefill" else f"decode B={self.batch} ctx {self.context}")


def prefill(seq_len: int, batch: int = 1) -> ForwardShape:
    """``batch`` prompts of ``seq_len`` tokens, nothing cached before them."""
    return ForwardShape("prefill", batch, seq_len, seq_len)


def decode(batch: int, context: int) -> ForwardShape:
    """One new token for each of ``batch`` sequences, each over ``context`` tokens of KV."""
    return ForwardShape("decode", batch, 1, context)


def forward_cost(config: ModelConfig, shape: ForwardShape, dtype_bytes: int | None = None
                 ) -> dict:
    """FLOPs and bytes of one forward: the least an ideal implementation moves.

    Weights are read once per forward; each sequence reads its KV once and writes its new K/V;
    each matmul reads its input and writes its output (norms, RoPE and SiLU are left out).
    Attention counts the (query, key) pairs it needs: causal prefill S(S+1)/2, decode C.
    """
    c, e = config, dtype_bytes or config.dtype.itemsize
    h, q, kv, i, L, V = (c.hidden_size, c.q_size, c.kv_size, c.intermediate_size,
                         c.num_hidden_layers, c.vocab_size)
    T, rows = shape.batch * shape.tokens, shape.batch  # each sequence samples its last token
    matmul_params = h * (q + 2 * kv) + q * h + 3 * h * i
    past = shape.context - shape.tokens
    pairs = shape.batch * (shape.tokens * past + shape.tokens * (shape.tokens + 1) // 2)
    cost = {"linear_flops": 2 * T * L * matmul_params + 2 * rows * V * h,
            "attention_flops": 4 * c.num_attention_heads * c.head_dim * L * pairs,
            "weight_bytes": e * (L * (matmul_params + 2 * h) + h + V * h),
            "kv_bytes": e * L * 2 * kv * shape.batch * (shape.tokens + shape.context),
            "activation_bytes": e * (T * h + L * T * (4 * h + 2 * q + 2 * kv + 3 * i)
                                     + rows * (h + V))}
    flops = cost["linear_flops"] + cost["attention_flops"]
    nbytes = cost["weight_bytes"] + cost["kv_bytes"] + cost["activation_bytes"]
    return {"shape": shape.name, "kind": shape.kind, "batch": shape.batch,
            "tokens": shape.tokens, "context": shape.context, **cost, "flops": flops,
            "bytes": nbytes, "flops_per_byte": flops / nbytes}


def cost_table(config: ModelConfig, shapes: Sequence[ForwardShape],
               dtype_bytes: int | None = None) -> pd.DataFrame:
    """The arithmetic behind each roofline point, one row per shape, in GFLOP and MB."""
    df = pd.DataFrame([forward_cost(config, s, dtype_bytes) for s in shapes]).set_index("shape")
    scale = {c: 1e9 if c.endswith("flops") else 1e6 for c in df.columns if c.endswith(("flops",
             "bytes"))}
    out = (df[list(scale)] / pd.Series(scale)).rename(
        columns=lambda c: c.replace("flops", "GFLOP").replace("bytes", "MB"))
    return out.assign(flops_per_byte=df.flops_per_byte)


def decode_intensity(config: ModelConfig, batch: int, context: int,
                     dtype_bytes: int | None = None) -> float:
    """FLOPs per byte of a decode step; ``context=0``: the weights alone (no KV, no attention)."""
    d = forward_cost(config, decode(batch, max(context, 1)), dtype_bytes)
    return d["linear_flops"] / (d["bytes"] - d["kv_bytes"]) if context == 0 else \
        d["flops_per_byte"]


def knee_batch(config: ModelConfig, context: int, ridge: float, dtype_bytes: int | None = None,
               max_batch: int = 2**20) -> int | None:
    """Smallest decode batch at ``ridge`` FLOPs per byte or more (compute-bound), or None: each
    row's KV read adds bytes as its attention adds FLOPs, so long contexts level off below."""
    lo, hi = 1, max_batch
    if decode_intensity(config, hi, context, dtype_bytes) < ridge:  # grows with the batch
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if decode_intensity(config, mid, context, dtype_bytes) < ridge \
            else (lo, mid)
    return lo


def knee_table(contexts: Sequence[int], cases: dict[str, tuple[ModelConfig, float]]
               ) -> pd.DataFrame:
    """One row per context; per named ``(config, ridge)`` case, the knee batch as an integer,
    or "never" where the step levels off below the ridge."""
    return pd.DataFrame({"context": [int(c) for c in contexts], **{
        name: pd.Series([knee_batch(cfg, c, ridge) or "never" for c in contexts], dtype=object)
        for name, (cfg, ridge) in cases.items()}})
