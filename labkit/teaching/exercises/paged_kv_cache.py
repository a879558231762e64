"""Notebook 05's exercises: a token's slot, and the prefix-hit lookup of a block manager.

05.1: ``slot_mapping(block_table, start, end, block_size)``, the slots of token positions
[start, end), checked against ``BlockManager.slots`` on fragmented block tables.

05.2: ``cached_prefix_len(registered, token_ids, block_size)``: how many leading tokens the
prefix cache serves, from the set of registered block hashes. A block's hash chains its
parent's hash with its own token ids (``chain_hash``); the lookup stops at the first miss and
never serves the whole prompt. Checked against ``BlockManager.cached_prefix_len`` on random
prompts sharing prefixes with cached, evicted and partly cached ones.
"""
from __future__ import annotations

import random
from array import array

from labkit.teaching.exercises import Case, Exercise
from labkit.kvcache import BlockManager
from labkit.kvcache.prefix_cache import block_hash, root_hash

ROOT = root_hash(b"")  # the parent hash of a prompt's first block (no extra key)


def chain_hash(parent_hash: bytes, block_tokens) -> bytes:
    """The hash of one full block: its parent block's hash and its own token ids."""
    return block_hash(parent_hash, array("q", block_tokens).tobytes())


def registered_hashes(bm: BlockManager) -> frozenset:
    """The hashes a prompt could hit now: every block registered in the prefix cache."""
    return frozenset(h for b in range(bm.num_blocks) if (h := bm._prefix.hash_of(b)) is not None)


# --- 05.1 slot mapping ------------------------------------------------------------------------
def _fragmented_manager(rng: random.Random, block_size: int) -> tuple[BlockManager, str, int]:
    """A manager whose sequence 'x' holds scattered blocks (others came and went first)."""
    bm = BlockManager(64, block_size, enable_prefix_caching=False)
    for s in range(6):
        bm.allocate(s, [0] * rng.randrange(1, 3 * block_size))
    for s in rng.sample(range(6), 3):
        bm.free(s)
    n = rng.randrange(2 * block_size + 1, 5 * block_size)
    bm.allocate("x", list(range(n)))
    return bm, "x", n


def _slot_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    bm, seq, n = _fragmented_manager(rng, bs)
    table = bm.block_table(seq)
    ranges = [("the whole sequence", 0, n), ("no tokens (start == end)", 5, 5),
              ("one token", n - 1, n), (f"crossing a block boundary at {bs}", bs - 2, bs + 3),
              ("ending exactly at a block's end", bs, 2 * bs),
              ("starting mid-block", rng.randrange(1, bs), n)]
    return [Case(label, (table, start, end, bs), {"expected": bm.slots(seq, start, end)})
            for label, start, end in ranges]


def _slot_run(fn, case: Case) -> dict:
    return {"slots": fn(*case.args)}


def _slot_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    slots, want = got.get("slots"), expected["slots"]
    table, start, end, bs = case.args
    if isinstance(slots, (list, tuple)) and len(slots) == len(want) and want:
        bad = next(i for i, (a, b) in enumerate(zip(slots, want)) if a != b)
        pos = start + bad
        return (f"Token {pos} lives in logical block {pos // bs} (position {pos} // {bs}), which "
                f"is physical block {table[pos // bs]}, at offset {pos % bs}: slot "
                f"{table[pos // bs]} * {bs} + {pos % bs} = {want[bad]}.")
    return None


# --- 05.2 prefix-hit lookup -----------------------------------------------------------------
def _prefix_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])

    def tokens(n):
        return [rng.randrange(1000) for _ in range(n)]

    system, other = tokens(3 * bs), tokens(2 * bs)
    bm = BlockManager(24, bs)
    bm.allocate("a", system + tokens(bs + 1))        # caches the system prompt's 3 blocks
    bm.allocate("b", other + tokens(bs // 2 + 1))
    bm.free("b")                                      # evictable, still findable
    bm.allocate("c", tokens(19 * bs))                 # 17 blocks are free: evicts b's two
    diverge = system[:bs] + [(system[bs] + 1) % 1000] + system[bs + 1:]  # differs in block 1
    queries = [
        ("the system prompt and a new question", system + tokens(rng.randrange(1, 2 * bs))),
        ("exactly the system prompt (one token must stay to compute)", list(system)),
        ("a prompt that differs from the system prompt in its second block", diverge + tokens(bs)),
        ("one token", system[:1]),
        ("an empty prompt", []),
        ("a prompt whose blocks were evicted", other + tokens(bs)),
        (f"not a multiple of the block ({3 * bs + bs // 2 + 1} tokens)", system + tokens(bs // 2 + 1)),
    ]
    registered = registered_hashes(bm)
    return [Case(label, (registered, q, bs), {"expected": bm.cached_prefix_len(q)})
            for label, q in queries]


def _prefix_run(fn, case: Case) -> dict:
    return {"cached tokens": fn(*case.args)}


def _prefix_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    registered, tokens, bs = case.args
    n, want = got.get("cached tokens"), expected["cached tokens"]
    if not isinstance(n, int):
        return "Return a number of tokens (an int)."
    if n == len(tokens) and n:
        return ("You served the whole prompt from the cache: the model still needs one token's "
                "logits to sample the next. Look up at most (len(token_ids) - 1) // block_size "
                "blocks.")
    if n % bs:
        return f"The cache serves whole blocks only: {n} is not a multiple of {bs}."
    if n > want:
        return ("You counted a block after a miss, or hashed each block on its own: a block's "
                "hash must chain its parent's hash, and the lookup stops at the first miss.")
    return ("You found fewer cached blocks than there are: hash block i with chain_hash(hash of "
            "block i-1, its tokens), starting from ROOT.")


EXERCISES = [
    Exercise(
        id="05.1", title="slot mapping through a block table", entry="slot_mapping",
        task="return the slot of every token position in [start, end)",
        cases=_slot_cases, run=_slot_run, expected=lambda c: {"slots": c.kwargs["expected"]},
        diagnose=_slot_diagnose,
        hints=("Position p is in logical block `p // block_size`, at offset `p % block_size`.",
               "`block_table[logical]` is the physical block; its first slot is "
               "`physical * block_size`.",
               "An empty range gives an empty list."),
        seen="Slots jump wherever the block table jumps: the sequence's blocks are scattered over "
             "the cache, yet each token's KV is one multiply-add away. This list is the "
             "`slot_mapping` tensor an engine hands to the kernel that writes new keys and values "
             "(`kernels/store_kv.py`).",
    ),
    Exercise(
        id="05.2", title="the prefix-hit lookup", entry="cached_prefix_len",
        task="return how many leading tokens of token_ids the prefix cache serves",
        cases=_prefix_cases, run=_prefix_run,
        expected=lambda c: {"cached tokens": c.kwargs["expected"]}, diagnose=_prefix_diagnose,
        hints=("Block i's hash is `chain_hash(hash of block i-1, token_ids[i*bs:(i+1)*bs])`; block "
               "0's parent is `ROOT`.",
               "Stop at the first hash not in `registered`: later blocks' hashes chain through the "
               "missing one, so they cannot be cached for this prompt anyway.",
               "At least one token must be computed: only the first "
               "`(len(token_ids) - 1) // block_size` blocks may be served."),
        seen="The system prompt's blocks are found, a prompt that changes inside block 1 keeps only "
             "block 0, evicted blocks are misses, and a prompt that is exactly cached still "
             "computes its last block. Chaining is what makes one dictionary lookup per block "
             "enough: equal hashes mean equal whole prefixes, not just equal blocks.",
    ),
]
