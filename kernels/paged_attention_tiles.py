"""The tile plan of ``paged_attention``: what one batch's launch compiles, and why.

``tile_plan`` picks the kernel's tile constants (rows per program, keys per tile, whether block
ids are loaded a tile ahead, the causal mask) and its launch options (warps, pipeline stages)
from the batch's shape: decode or not, fp8 or not, the head width, and whether a split leaves
each program one key tile. Each choice says what it was measured against on an H200.
``tuning=`` overrides any of them (``TUNING_KEYS``, checked before any launch), which is how the
benchmarks race the alternatives.
"""
from __future__ import annotations

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
from labkit.device import interpreter_on
from labkit.kernels.grid import next_power_of_2

LEAN_DECODE_HEAD_DIM = 64  # the widest bf16/fp16 head decoded with fp8's lean tile (below)
WIDE_DECODE_HEAD_DIM = 128  # the widest decoded with 32-key tiles and the prefetch (below)

# What ``tuning=`` may override, and the values each key allows (checked before any launch, so
# a bad value is named here instead of surfacing as a compiler or interpreter error).
TUNING_KEYS = {  # key: (allowed values, what it sets)
    "block_n": ("a power of two from 16 to 256", "keys per tile: tl.dot needs at least 16"),
    "num_warps": ("one of (1, 2, 4, 8, 16, 32)", "warps per program"),
    "num_stages": ("a positive int", "software-pipelining stages"),
    "prefetch": ("True or False", "load block ids one tile ahead"),
    "maxnreg": ("an int from 24 to 255, or None", "registers per thread, ptx .maxnreg"),
}


def check_tuning(tuning) -> dict:
    """``tuning`` as a dict of known keys with allowed values, or an error naming the key."""
    if tuning is None:
        return {}
    if not isinstance(tuning, dict):
        raise TypeError(f"tuning must be a dict such as {{'block_n': 32}}, got "
                        f"{type(tuning).__name__}")
    unknown = sorted(str(k) for k in tuning if k not in TUNING_KEYS)
    if unknown:
        raise ValueError(f"unknown tuning keys {unknown}; known: {', '.join(TUNING_KEYS)}")
    for key, value in tuning.items():
        number = isinstance(value, int) and not isinstance(value, bool)
        ok = {"block_n": number and 16 <= value <= 256 and not value & (value - 1),
              "num_warps": number and value in (1, 2, 4, 8, 16, 32),
              "num_stages": number and value >= 1,
              "prefetch": isinstance(value, bool),
              "maxnreg": value is None or (number and 24 <= value <= 255)}[key]
        if not ok:
            allowed, what = TUNING_KEYS[key]
            raise ValueError(f"tuning['{key}'] must be {allowed}, got {value!r} ({what})")
    return dict(tuning)


def tile_plan(fp8: bool, head_dim: int, group: int, max_query_len: int, causal: bool,
              tuning: dict | None = None, one_tile: bool = False) -> tuple[dict, dict]:
    """What ``paged_attention`` compiles for a batch: the kernel's tile constants (GROUP,
    GROUP_P, BLOCK_Q, BLOCK_N, CAUSAL, SCALED, PREFETCH) and its launch options (num_warps,
    num_stages, maxnreg). ``one_tile``: no program reads more than one key tile (a split plan
    can make it so). ``labkit.lessons.attention_backends.sass`` compiles the same plan ahead of
    time to read the machine code a GPU runs."""
    tuning = check_tuning(tuning)
    group_p = next_power_of_2(group)
    row_cap = 32 if interpreter_on() else 64
    block_q = min(next_power_of_2(max_query_len), max(1, row_cap // group_p))
    if block_q == 1:  # decode: the rows are the group's heads, padded to the 16 tl.dot wants
        group_p = max(group_p, 16)
    block_q = max(block_q, 16 // group_p)  # tl.dot wants at least 16 rows
    # bf16/fp16 decode of heads wider than the lean tile's, up to 128: 32-key tiles with block
    # ids a tile ahead, four warps. On an H200, GQA 32/8 with head_dim 128 (attention and merge,
    # 5 interleaved rounds, L2 flushed below 100 MB), against 64-key tiles without the prefetch,
    # it won at each of 13 shapes: B1 at 1k 1.04x, 4k 1.13x, 32k 1.09x; B2 at 32k 1.05x; B8 at
    # 1k 1.24x, 4k 1.15x; B16 at 4k 1.10x; B64 at 1k 1.04x, 4k 1.03x (the least, B4 at 32k,
    # 1.02x). Each half alone lost at most shapes: the prefetch on 64-key tiles at 11 of the 13
    # (0.81-0.99x), 32-key tiles without it at 8 (0.91-0.995x).
    wide_decode = (max_query_len == 1 and not fp8
                   and LEAN_DECODE_HEAD_DIM < head_dim <= WIDE_DECODE_HEAD_DIM)
    block_n = tuning.get("block_n", 16 if interpreter_on() else
                         (32 if wide_decode or head_dim > 128 else 64))
    # Decode streams each key once: two warps keep more programs resident per SM, and block ids
    # loaded a tile ahead let a program's K/V loads pipeline across its tiles. fp8 tiles (half
    # the bytes) always; bf16 decode of heads up to 64 wide too, where programs read more than
    # one tile. On an H200, GQA 32/8 with head_dim 64 (attention and merge, 7 interleaved rounds,
    # read from HBM), against four warps without the prefetch: B8 at 1k keys 1.27x, B64 1.29x,
    # B64 at 4k 1.35x (4.0 TB/s), B1 at 32k 1.18x; bench_1b's replayed decode step 1.02x at B8,
    # 1.05x at B64. With one tile a program (B1 at 1k: 17 splits of 64 keys) the lone wave is
    # latency-bound: the step lost 0.982x (0.978-0.983), so four warps stay. Heads 128 wide lost
    # (B64 at 4k 0.76x, B1 at 32k 0.86x).
    lean = fp8 or (max_query_len == 1 and head_dim <= LEAN_DECODE_HEAD_DIM and not one_tile)
    launch = {"num_warps": tuning.get("num_warps", 2 if lean else 4),
              "num_stages": tuning.get("num_stages", 3)}
    if tuning.get("maxnreg") is not None:  # a cap on registers per thread (ptx .maxnreg)
        launch["maxnreg"] = tuning["maxnreg"]
    prefetch = tuning.get("prefetch", lean or wide_decode)
    # One new token per sequence (decode) sees every cached key, so its causal mask keeps them
    # all. fp8 decode is built without it: Triton then pipelines the fp8 K/V loads, a gain on
    # an H200 (B64 ctx 4k). bf16 keeps it: without it, its split path is slower (B1, 32k keys).
    causal_mask = bool(causal) and not (fp8 and max_query_len == 1)
    return ({"GROUP": group, "GROUP_P": group_p, "BLOCK_Q": block_q, "BLOCK_N": block_n,
             "CAUSAL": causal_mask, "SCALED": fp8, "PREFETCH": prefetch}, launch)


if __name__ == "__main__":
    from unittest import mock

    # The plan a GPU gets, here too: under the interpreter tile_plan shrinks the tiles so that
    # small tests still loop over several of them.
    with mock.patch.dict(globals(), interpreter_on=lambda: False):
        print("The tile plan paged_attention compiles on a GPU, GQA 32/8:")
        for label, fp8, head_dim, query in (("decode, bf16, head_dim 64", False, 64, 1),
                                            ("decode, bf16, head_dim 128", False, 128, 1),
                                            ("decode, fp8, head_dim 128", True, 128, 1),
                                            ("verify 5 tokens, bf16, head_dim 128", False, 128, 5),
                                            ("prefill chunk, bf16, head_dim 128", False, 128, 512)):
            consts, launch = tile_plan(fp8, head_dim, 4, query, causal=True)
            print(f"  {label:<37} {consts['BLOCK_Q'] * consts['GROUP_P']:>2} rows, "
                  f"{consts['BLOCK_N']:>2}-key tiles, {launch['num_warps']} warps, "
                  f"{launch['num_stages']} stages, block ids a tile ahead: {consts['PREFETCH']}")
        consts, launch = tile_plan(False, 128, 4, 1, True)
        assert (consts["BLOCK_N"], launch["num_warps"], consts["PREFETCH"]) == (32, 4, True)
    assert check_tuning({"block_n": 32}) == {"block_n": 32}
