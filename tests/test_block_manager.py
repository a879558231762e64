"""The block manager's contract: block counts, errors, prefix hits, eviction order, fork and CoW."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kvcache import BlockManager, OutOfBlocks
from labkit.kvcache.prefix_cache import block_hash

BS = 4


def prompt(n, start=0):
    return list(range(start, start + n))


# ---------------------------------------------------------------- blocks and slots
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 13])
def test_a_prompt_of_n_tokens_holds_ceil_n_over_block_size_blocks(n):
    bm = BlockManager(16, BS)
    bm.allocate("a", prompt(n))
    assert len(bm.block_table("a")) == -(-n // BS), f"{n} tokens in blocks of {BS}"
    assert len(set(bm.block_table("a"))) == len(bm.block_table("a")), "a table repeats a block"


def test_append_token_takes_a_new_block_exactly_when_the_last_one_is_full():
    bm = BlockManager(16, BS)
    bm.allocate("a", prompt(3))
    sizes = []
    for t in range(6):
        bm.append_token("a", t)
        sizes.append(len(bm.block_table("a")))
    assert sizes == [1, 2, 2, 2, 2, 3], "tokens 4..9 of a sequence in blocks of 4"


def test_slots_are_block_number_times_block_size_plus_offset():
    bm = BlockManager(16, BS)
    bm.allocate("x", prompt(2))
    bm.allocate("a", prompt(6, 100))
    table = bm.block_table("a")
    assert bm.slots("a", 0, 6) == [table[p // BS] * BS + p % BS for p in range(6)]
    assert bm.slots("a", 3, 3) == [], "an empty range has no slots"
    with pytest.raises(ValueError, match="outside sequence"):
        bm.slots("a", 0, 7)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 16]), st.integers(1, 70), st.integers(1, 9), st.data())
def test_slots_of_any_range_follow_the_table_position_by_position(bs, n, other, data):
    bm = BlockManager(80, bs)  # room for both at one token a block
    bm.allocate("x", prompt(other, 500))  # another sequence first: the tables interleave
    bm.allocate("a", prompt(n, 100))
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    table = bm.block_table("a")
    assert bm.slots("a", start, end) == [table[p // bs] * bs + p % bs for p in range(start, end)]


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (8, 0), (8, -16), (8, 12)])
def test_bad_sizes_are_refused_with_a_value_error(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        BlockManager(num_blocks, block_size)


def test_a_duplicate_seq_id_is_refused_and_nothing_changes():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(5))
    before = bm.snapshot()
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("a", prompt(3))
    with pytest.raises(ValueError, match="already exists"):
        bm.fork("a", "a")
    assert bm.snapshot() == before


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        BlockManager(8, BS).allocate("a", [])


@pytest.mark.parametrize("op", ["append", "fork", "free", "table"])
def test_an_unknown_seq_id_is_refused(op):
    bm = BlockManager(8, BS)
    call = {"append": lambda: bm.append_token("nope", 1), "fork": lambda: bm.fork("nope", "b"),
            "free": lambda: bm.free("nope"), "table": lambda: bm.block_table("nope")}[op]
    with pytest.raises(ValueError, match="unknown sequence 'nope'"):
        call()


# ---------------------------------------------------------------- out of blocks
def test_out_of_blocks_on_allocate_says_needed_and_free_and_changes_nothing():
    bm = BlockManager(4, BS)
    bm.allocate("a", prompt(9))           # 3 blocks
    before = bm.snapshot()
    with pytest.raises(OutOfBlocks, match=r"needs 2 new block\(s\) but only 1 of 4") as e:
        bm.allocate("b", prompt(5, 50))
    assert (e.value.needed, e.value.available) == (2, 1)
    assert bm.snapshot() == before, "a failed allocate must leave no half-allocated sequence"
    assert "b" not in bm


def test_out_of_blocks_with_partial_prefix_hit_changes_nothing():
    bm = BlockManager(4, BS)
    bm.allocate("a", prompt(8))
    bm.free("a")                          # 2 cached blocks
    bm.allocate("x", prompt(4, 90))       # takes a free block
    before = bm.snapshot()
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", prompt(8) + prompt(9, 200))  # 1 hit (+1 not looked up) and 3 more
    assert bm.snapshot() == before, "the cached hit must not be revived by a failed allocate"


def test_out_of_blocks_on_append_changes_nothing():
    bm = BlockManager(2, BS)
    bm.allocate("a", prompt(8))
    before = bm.snapshot()
    with pytest.raises(OutOfBlocks, match="append_token"):
        bm.append_token("a", 9)
    assert bm.snapshot() == before


def test_out_of_blocks_on_copy_on_write_changes_nothing():
    bm = BlockManager(2, BS)
    bm.allocate("a", prompt(6))
    bm.fork("a", "b")
    before = bm.snapshot()
    with pytest.raises(OutOfBlocks):
        bm.append_token("b", 9)
    assert bm.snapshot() == before


def test_can_allocate_and_can_append_predict_the_outcome():
    bm = BlockManager(3, BS)
    bm.allocate("a", prompt(8))
    assert bm.can_append("a") and bm.can_allocate(prompt(4, 30))
    assert not bm.can_allocate(prompt(5, 30)), "5 tokens need 2 blocks, 1 is free"
    bm.allocate("b", prompt(4, 30))
    assert not bm.can_append("a")


# ---------------------------------------------------------------- prefix caching
def test_a_prompt_allocated_again_after_its_owner_was_freed_hits_the_cache():
    bm = BlockManager(8, BS)
    p = prompt(10)
    assert bm.allocate("a", p) == 0
    first = bm.block_table("a")
    bm.free("a")
    assert bm.allocate("b", p) == 8, "the two full blocks of 10 tokens come from the cache"
    assert bm.block_table("b")[:2] == first[:2]
    assert bm.stats.hits == 2 and bm.stats.hit_rate == pytest.approx(8 / 20)


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(8))
    bm.free("a")
    assert bm.allocate("b", prompt(8)) == 4, "the model needs the last prompt token's logits"


def test_running_sequences_share_full_prefix_blocks_with_ref_counts():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(9))
    bm.allocate("b", prompt(8) + [77, 78])
    a, b = bm.block_table("a"), bm.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2], "full blocks shared, partial ones private"
    assert [bm.ref_count(x) for x in a] == [2, 2, 1]


def test_only_full_blocks_are_shared():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(6))
    bm.allocate("b", prompt(6))
    assert bm.block_table("a")[1] != bm.block_table("b")[1], "the partial block is not shared"


def test_a_block_filled_by_decode_is_found_by_a_later_prompt():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(3))
    for t in [3, 4, 5, 6, 7]:
        bm.append_token("a", t)
    bm.free("a")
    assert bm.allocate("b", prompt(9)) == 8


def test_an_extra_key_separates_otherwise_equal_prompts():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(9), extra_key="tenant-1")
    bm.free("a")
    assert bm.allocate("b", prompt(9), extra_key="tenant-2") == 0
    assert bm.allocate("c", prompt(9), extra_key="tenant-1") == 8


def test_a_forced_hash_collision_never_serves_the_wrong_tokens():
    bm = BlockManager(8, BS, hash_fn=lambda parent, tokens: b"same")
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.free("a")
    assert bm.allocate("b", [9, 9, 9, 9, 5]) == 0, "equal hash, different tokens: a miss"
    assert bm.allocate("c", [1, 2, 3, 4, 5]) == 4, "equal hash, equal tokens: a hit"


def test_a_hash_that_ignores_the_parent_still_never_serves_another_prefix():
    # This hash names a block by its own tokens only, so [0,0,0,0] after [1,2,3,4] and after
    # [5,6,7,8] collide. The stored key links each block to the block it was computed after.
    bm = BlockManager(8, BS, hash_fn=lambda parent, tokens: tokens)
    bm.allocate("c", [5, 6, 7, 8, 3])
    bm.allocate("a", [1, 2, 3, 4, 0, 0, 0, 0, 9])
    assert bm.allocate("b", [5, 6, 7, 8, 0, 0, 0, 0, 9]) == 4, \
        "b's first block is c's; its second has a's tokens but a different prefix: a miss"
    assert bm.block_table("b")[1] != bm.block_table("a")[1]


def test_freed_cached_blocks_are_evicted_least_recently_released_first():
    bm = BlockManager(6, BS)
    bm.allocate("a", prompt(8, 0))
    bm.allocate("b", prompt(8, 100))
    bm.allocate("c", prompt(8, 200))
    a, b, c = (bm.block_table(s) for s in "abc")
    bm.free("a"); bm.free("b"); bm.free("c")
    bm.allocate("d", prompt(5, 0))                 # hit on a's first block: a's used again
    bm.free("d")
    assert bm.evictable_blocks()[:4] == b[::-1] + c[::-1], "oldest release first, tail first"
    bm.allocate("e", prompt(12, 900))              # 3 new blocks: the free one, then b's two
    assert bm.stats.evictions == 3
    assert bm.allocate("f", prompt(5, 0)) == 4, "a's prefix was used most recently: kept"
    bm.free("f")
    assert bm.allocate("g", prompt(5, 100)) == 0, "b's blocks were the oldest: evicted"


def test_evicted_blocks_are_never_hit():
    bm = BlockManager(2, BS)
    bm.allocate("a", prompt(5))
    bm.free("a")
    bm.allocate("b", prompt(8, 50))                # needs both blocks: evicts a's
    bm.free("b")
    assert bm.allocate("c", prompt(5)) == 0


def test_num_free_blocks_counts_evictable_cached_blocks():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(10))
    bm.free("a")
    s = bm.stats
    assert (s.blocks_cached, s.blocks_free, bm.num_free_blocks) == (2, 6, 8)


def test_block_hash_is_the_same_in_every_process_and_on_every_machine():
    # Python's hash() of bytes is salted per process (PYTHONHASHSEED): it could not name blocks
    # shared between workers or kept on disk. BLAKE2b gives this value everywhere.
    assert block_hash(b"parent", bytes(range(64))).hex() == "587d3b542a4f862326942420f6b328b0"


# ---------------------------------------------------------------- fork and copy-on-write
def test_fork_shares_every_block_of_the_parent():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(6))
    bm.fork("a", "b")
    assert bm.block_table("b") == bm.block_table("a")
    assert all(bm.ref_count(x) == 2 for x in bm.block_table("a"))


def test_appending_into_a_shared_partial_block_copies_it_first():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(6))
    bm.fork("a", "b")
    shared = bm.block_table("a")[1]
    copies = bm.append_token("b", 42)
    assert len(copies) == 1 and copies[0][0] == shared, "copy the shared block's KV"
    dst = copies[0][1]
    assert bm.block_table("b")[1] == dst and bm.block_table("a")[1] == shared
    assert bm.ref_count(shared) == 1 and bm.ref_count(dst) == 1
    assert bm.append_token("a", 43) == [], "after the copy the parent owns its block alone"
    assert bm.append_token("b", 44) == [], "and so does the child"


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(8))
    bm.fork("a", "b")
    assert bm.append_token("a", 1) == [] and bm.append_token("b", 2) == []
    assert bm.block_table("a")[2] != bm.block_table("b")[2]


def test_a_shared_block_is_released_only_by_its_last_holder():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    bm.allocate("a", prompt(6))
    bm.fork("a", "b")
    bm.free("a")
    assert bm.num_free_blocks == 2 and all(bm.ref_count(x) == 1 for x in bm.block_table("b"))
    bm.free("b")
    assert bm.num_free_blocks == 4


def test_without_prefix_caching_nothing_is_shared_or_kept():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    bm.allocate("a", prompt(8))
    assert bm.allocate("b", prompt(8)) == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.free("a"); bm.free("b")
    s = bm.stats
    assert (s.blocks_free, s.blocks_cached, s.hits) == (8, 0, 0)


def test_a_token_that_is_not_an_int_is_refused_before_anything_changes():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(3))
    before = bm.snapshot()
    with pytest.raises(TypeError):
        bm.append_token("a", 1.5)
    assert bm.snapshot() == before


def test_cached_prefix_len_looks_up_without_changing_anything():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    bm.allocate("a", prompt)
    bm.free("a")
    before = (bm.snapshot(), bm.stats)
    assert bm.cached_prefix_len(prompt) == 8, "two full blocks cached, one token left to compute"
    assert bm.cached_prefix_len(list(range(3))) == 0
    assert (bm.snapshot(), bm.stats) == before, "a lookup must not touch counters or LRU order"
