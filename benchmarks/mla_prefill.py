"""MLA prefill on a GPU: the absorbed latent kernel against decompressed keys and values.

    python benchmarks/mla_prefill.py --out results/      # prints, writes mla_prefill.json

Decode attends over the latent rows (``paged_mla_attention``): one row read serves every head.
Prefill has many queries per key, so it may instead up-project the rows into per-head keys and
values once and run ordinary attention (``flash_attention``). Per (query, key) pair the absorbed
path multiplies 512 + 64 values for the score and 512 for the value; the decompressed one 192
and 128, padded to the kernel's power of two (256 each). Which is faster is measured here, at
DeepSeek-V3's attention shape (128 heads, latent 512 + 64, keys of 128 + 64, values of 128),
bf16, one causal sequence of 1,024 to 16,384 tokens over a paged cache, both paths ending in the
per-head outputs o_proj takes, in interleaved rounds (median and range). Both paths are the
engine's own code (``labkit.engine.mla_prefill``): a paged MLA step sends every sequence with at
least ``DECOMPRESS_MIN_NEW_TOKENS`` new tokens down the decompressed path and keeps decode rows
on the absorbed kernel, because this measurement found the decompressed path the faster prefill.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import labkit  # noqa: F401  (device set-up before anything imports triton)
from labkit.device import describe, free_memory
from labkit.engine import ModelConfig
from labkit.engine.mla import MLAAttention
from labkit.lessons.mla import prefill_flops, prefill_paths
from labkit.measure.bench import flush_needed, l2_statement, save_results
from labkit.measure.rounds import interleaved

DEV = "cuda"
ROUNDS = 5
LENGTHS = (1024, 4096, 16384)
BLOCK = 64
# DeepSeek-V3's attention dims; the width of the hidden state does not enter attention
DEEPSEEK_ATTENTION = dict(hidden_size=1024, num_attention_heads=128, num_key_value_heads=128,
                          kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, max_position_embeddings=32768)


def case(attention: MLAAttention, seq_len: int, seed: int = 0) -> dict:
    c, g = attention.config, torch.Generator(device="cpu").manual_seed(seed)
    blocks = -(-seq_len // BLOCK)
    cache = torch.randn(blocks, BLOCK, c.latent_size, generator=g).to(DEV, torch.bfloat16)
    table = torch.randperm(blocks, generator=g)[None].int().to(DEV)
    q_nope = torch.randn(seq_len, c.num_attention_heads, c.qk_nope_head_dim,
                         generator=g).to(DEV, torch.bfloat16)
    q_pe = torch.randn(seq_len, c.num_attention_heads, c.qk_rope_head_dim,
                       generator=g).to(DEV, torch.bfloat16)
    return prefill_paths(attention, q_nope, q_pe, cache, table, seq_len)


def bytes_read(attention: MLAAttention, seq_len: int) -> int:
    """What one prefill call reads: the queries, the sequence's latent rows and kv_b_proj (W_UK
    and W_UV), all bf16. At 1,024 tokens they fit in twice the L2, so those rounds flush it."""
    c, w = attention.config, attention.kv_b_proj.weight
    q = seq_len * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    rows = -(-seq_len // BLOCK) * BLOCK * c.latent_size
    return (q + rows + w.numel()) * w.element_size()


@torch.no_grad()
def run(out_dir: Path | None = None) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mla_prefill.py needs a CUDA GPU")
    print(describe())
    config = ModelConfig.tiny(**DEEPSEEK_ATTENTION)
    attention = MLAAttention(config, device=DEV, dtype=torch.bfloat16)
    torch.nn.init.normal_(attention.kv_b_proj.weight, std=0.02)
    results = {}
    for seq_len in LENGTHS:
        paths = case(attention, seq_len)
        a, d = paths["absorbed"](), paths["decompressed"]()
        err = float((a.float() - d.float()).abs().max() / d.float().abs().max())
        flush = flush_needed(bytes_read(attention, seq_len), DEV)
        timings = interleaved(paths, rounds=ROUNDS, device=DEV, warmup=2, repeats=5,
                              flush_l2=flush)
        flops = prefill_flops(config, seq_len)
        row = {"max_rel_diff": err,
               "l2": l2_statement(bytes_read(attention, seq_len), DEV, flushed=flush)}
        for name in paths:
            us = timings.us(name)
            row[name] = {"us": us.median, "us_range": [us.low, us.high],
                         "tflops": flops[name] / (us.median * 1e6)}
        ratio = timings.ratio("absorbed", "decompressed")
        row["absorbed_over_decompressed"] = [ratio.median, ratio.low, ratio.high]
        faster = "decompressed" if ratio.low > 1 else ("absorbed" if ratio.high < 1 else
                                                       "neither (ranges overlap)")
        row["faster"] = faster
        print(f"prefill {seq_len:>6} tokens: absorbed {row['absorbed']['us']:9.1f} us "
              f"({row['absorbed']['tflops']:.0f} TFLOP/s), decompressed "
              f"{row['decompressed']['us']:9.1f} us ({row['decompressed']['tflops']:.0f} "
              f"TFLOP/s); absorbed / decompressed {ratio.median:.2f} ({ratio.low:.2f}-"
              f"{ratio.high:.2f}): faster {faster}; outputs differ by {err:.1e} (relative); "
              f"L2: {row['l2']}")
        results[seq_len] = row
        del paths
        free_memory(DEV)
    save_results(out_dir, "mla_prefill.json", results)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for mla_prefill.json")
    run(parser.parse_args().out)
