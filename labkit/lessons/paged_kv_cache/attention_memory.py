"""What one token's KV cache costs under each attention scheme, for one model's attention dims.

Per token and layer the cache holds
- MHA: a key and a value for every attention head: ``heads x (k_head_dim + v_head_dim)``;
- GQA: the same for each of the fewer KV heads, each shared by a group of query heads:
  ``kv_heads x (k_head_dim + v_head_dim)``;
- MLA: one latent ``c_kv`` of ``kv_lora_rank`` values and one RoPE key of ``qk_rope_head_dim``
  values, shared by *all* heads: keys and values are both recomputed from the latent (or the
  up-projections are absorbed into the query and output projections), so there is no separate V.

The dims are a model's config values (parameters), not measurements: ``DEEPSEEK_V3`` is read off
DeepSeek-V3's ``config.json``, whose ``k_head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from labkit import check_positive_int

GIB = 2**30


@dataclass(frozen=True)
class AttentionDims:
    """A model's attention shape as its config gives it (Hugging Face DeepSeek-V3 names)."""
    num_hidden_layers: int
    num_attention_heads: int
    qk_nope_head_dim: int     # the part of each head's key that carries no position
    qk_rope_head_dim: int     # the part rotated by RoPE (MLA caches it once, for all heads)
    v_head_dim: int
    kv_lora_rank: int         # width of MLA's compressed KV latent

    def __post_init__(self):
        for name in ("num_hidden_layers", "num_attention_heads", "qk_rope_head_dim",
                     "v_head_dim", "kv_lora_rank"):
            check_positive_int(name, getattr(self, name))
        if isinstance(self.qk_nope_head_dim, bool) or not isinstance(self.qk_nope_head_dim, int) \
                or self.qk_nope_head_dim < 0:
            raise ValueError(f"qk_nope_head_dim must be an int >= 0, got {self.qk_nope_head_dim!r}")

    @property
    def k_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers 61, num_attention_heads 128,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, kv_lora_rank 512.
DEEPSEEK_V3 = AttentionDims(num_hidden_layers=61, num_attention_heads=128, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)


def cached_values_per_token_layer(dims: AttentionDims, scheme: str, kv_heads: int | None = None
                                  ) -> int:
    """Values one token leaves in one layer's cache: ``scheme`` "MHA", "GQA" (``kv_heads``
    KV heads) or "MLA"."""
    if scheme == "MHA":
        return dims.num_attention_heads * (dims.k_head_dim + dims.v_head_dim)
    if scheme == "GQA":
        check_positive_int("kv_heads", kv_heads, hint="KV heads of the GQA row")
        if dims.num_attention_heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must divide num_attention_heads="
                             f"{dims.num_attention_heads}: each KV head serves a whole group")
        return kv_heads * (dims.k_head_dim + dims.v_head_dim)
    if scheme == "MLA":
        return dims.kv_lora_rank + dims.qk_rope_head_dim
    raise ValueError(f"scheme must be 'MHA', 'GQA' or 'MLA', got {scheme!r}")


def attention_memory_table(dims: AttentionDims = DEEPSEEK_V3, gqa_kv_heads: int = 8,
                           bytes_per_value: int = 2) -> pd.DataFrame:
    """MHA, GQA and MLA rows for the same attention dims: values cached per token and layer,
    bytes per token (all layers; ``bytes_per_value`` 2 for bf16, 1 for fp8, scales ignored),
    tokens one GiB holds, and each row's bytes over MLA's."""
    check_positive_int("bytes_per_value", bytes_per_value, hint="2 for bf16, 1 for fp8")
    rows = []
    for scheme, label in (("MHA", f"MHA ({dims.num_attention_heads} KV heads)"),
                          ("GQA", f"GQA ({gqa_kv_heads} KV heads)"),
                          ("MLA", f"MLA (latent {dims.kv_lora_rank} + rope "
                                  f"{dims.qk_rope_head_dim}, all heads)")):
        values = cached_values_per_token_layer(dims, scheme, gqa_kv_heads)
        per_token = values * dims.num_hidden_layers * bytes_per_value
        rows.append({"scheme": label, "values per token and layer": values,
                     "bytes per token": per_token, "KiB per token": per_token / 1024,
                     "tokens per GiB": GIB // per_token})
    table = pd.DataFrame(rows)
    table["bytes vs MLA"] = table["bytes per token"] / table["bytes per token"].iloc[-1]
    return table
