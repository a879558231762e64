"""How fast the block manager's bookkeeping is on this CPU, against its speed targets.

The block manager runs on the host between GPU steps; every microsecond it takes is a
microsecond the GPU may wait. Two figures:

- ``append_token`` calls per second on a warm manager (64 running sequences, decode): the call an
  engine makes once per sequence per step. Target: at least 500,000/s.
- allocating a 4,096-token prompt with prefix caching (256 blocks of 16): cold (every block
  a miss, the previous prompt's cached blocks evicted) and warm (the same prompt again, all hits
  but the last block). Target: under 2 ms.

Run: ``python benchmarks/block_manager.py``

The GPU's L2 plays no part: this is host bookkeeping on Python objects, timed by the host clock.
"""
import random
import statistics
import time

import labkit  # noqa: F401
from labkit.kvcache import BlockManager

APPEND_TARGET_PER_S = 500_000
ALLOCATE_TARGET_MS = 2.0


def append_rate(num_seqs: int = 64, steps: int = 4000, enable_prefix_caching: bool = True,
                repeats: int = 5) -> float:
    """Median append_token calls per second over ``repeats`` runs of ``steps`` decode steps."""
    rates = []
    for r in range(repeats):
        bm = BlockManager(num_seqs * (steps // 16 + 4), 16, enable_prefix_caching)
        for s in range(num_seqs):
            bm.allocate(s, [r, s, 1, 2, 3])
        for s in range(num_seqs):  # warm: every sequence has already decoded a while
            for t in range(40):
                bm.append_token(s, t)
        append, seqs = bm.append_token, range(num_seqs)
        t0 = time.perf_counter()
        for step in range(steps):
            for s in seqs:
                append(s, step)
        rates.append(steps * num_seqs / (time.perf_counter() - t0))
    return statistics.median(rates)


def allocate_ms(num_tokens: int = 4096, num_blocks: int = 256, block_size: int = 16,
                warm: bool = False, repeats: int = 30) -> float:
    """Median milliseconds of one ``allocate`` of a ``num_tokens`` prompt (then freed)."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    same = [rng.randrange(128_000) for _ in range(num_tokens)]
    bm.allocate("warm-up", same)
    bm.free("warm-up")
    times = []
    for i in range(repeats):
        prompt = same if warm else [rng.randrange(128_000) for _ in range(num_tokens)]
        t0 = time.perf_counter()
        bm.allocate(i, prompt)
        times.append((time.perf_counter() - t0) * 1e3)
        bm.free(i)
    if warm:
        assert bm.stats.hits >= repeats * (num_tokens // block_size - 1), "warm runs must hit"
    else:
        assert bm.stats.evictions > 0, "cold runs must evict the previous prompt's blocks"
    return statistics.median(times)


def main() -> None:
    print(f"{labkit.device.describe()}")
    print("L2: not a factor: host bookkeeping on Python objects, no GPU work is timed")
    for caching in (True, False):
        rate = append_rate(enable_prefix_caching=caching)
        ok = "met" if rate >= APPEND_TARGET_PER_S else "NOT met"
        print(f"append_token, prefix caching {'on ' if caching else 'off'}: {rate:12,.0f} calls/s "
              f"(target >= {APPEND_TARGET_PER_S:,}: {ok})")
    for warm in (False, True):
        ms = allocate_ms(warm=warm)
        ok = "met" if ms < ALLOCATE_TARGET_MS else "NOT met"
        what = "warm (all hits)   " if warm else "cold (miss, evict)"
        print(f"allocate 4,096 tokens, 256 blocks of 16, {what}: {ms:6.3f} ms "
              f"(target < {ALLOCATE_TARGET_MS} ms: {ok})")


if __name__ == "__main__":
    main()
