"""The engine serving a DeepSeek-shaped model (notebook 10, section 5)."""
from __future__ import annotations

from labkit.teaching import claim


def tiny_mla_config():
    """A DeepSeek-shaped model a CPU runs in seconds: 2 dense layers, 4 heads, latent 32 + rope
    16 (kv_lora_rank + qk_rope_head_dim), v_head_dim 20, no query compression."""
    from labkit.engine import ModelConfig
    return ModelConfig.tiny(num_key_value_heads=4, vocab_size=128, intermediate_size=96,
                            kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16,
                            v_head_dim=20)


def engine_tokens(model, prompts: list[list[int]], max_tokens: int, **options) -> tuple:
    """(each prompt's greedy tokens from LLM(model, **options), the engine's selection log)."""
    from labkit.engine import LLM, SamplingParams
    llm = LLM(model, **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return [o.token_ids for o in outs], llm.selection_log, llm.runner.cache.shape


def engine_claim(engine: list, reference: list, label: str):
    same = sum(a == b for a, b in zip(engine, reference))
    return claim("The engine ({label}) generated the same greedy tokens as the model's "
                 "decompressed forward recomputed at every step for {same} of {n} prompts.",
                 same == len(reference) > 0, label=label, same=same, n=len(reference))
