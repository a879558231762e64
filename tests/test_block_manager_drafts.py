"""The block manager under speculative decoding: draft tokens hold slots, only accepted ones are
sealed into the prefix cache, and rejected ones roll back without leaking a block."""
import pytest

from labkit.kvcache import BlockManager, OutOfBlocks

BS = 4


def prompt(n, start=0):
    return list(range(start, start + n))


def test_a_verify_step_writes_k_plus_1_slots_and_rejected_drafts_roll_back():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(3))
    bm.append_token("a", 3)                      # the last sampled token: its KV is not written
    assert bm.append_draft("a", [4, 5, 6, 7, 8]) == []
    assert (bm.num_tokens("a"), bm.num_draft_tokens("a")) == (9, 5)
    table = bm.block_table("a")
    assert len(table) == 3 and len(bm.slots("a", 3, 9)) == 6, "last token + 5 drafts"
    bm.accept_draft("a", 2)
    assert (bm.num_tokens("a"), bm.num_draft_tokens("a")) == (6, 0)
    assert bm.block_table("a") == table[:2], "the block past the new end is released"
    assert bm.ref_count(table[2]) == 0 and bm.num_free_blocks == 6
    bm.append_token("a", 99)                     # the target's own token follows the accepted
    assert bm.num_tokens("a") == 7


def test_blocks_filled_by_drafts_are_sealed_only_once_accepted():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(3))
    bm.append_draft("a", [3, 4, 5, 6, 7])        # fills blocks 0 and 1
    assert not any(bm.is_cached(b) for b in bm.block_table("a")), "drafts are never sealed"
    bm.accept_draft("a", 5)
    assert [bm.is_cached(b) for b in bm.block_table("a")] == [True, True]
    bm.free("a")
    assert bm.allocate("b", prompt(9)) == 8, "accepted drafts are found like any decode"


def test_a_rejected_draft_token_is_never_found_by_a_later_prompt():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(3))
    bm.append_draft("a", [3, 4, 5])              # the first block full only with a draft
    bm.accept_draft("a", 0)
    assert not bm.is_cached(bm.block_table("a")[0]), "the block ends in a rejected token"
    bm.append_token("a", 50)
    assert bm.is_cached(bm.block_table("a")[0]), "sealed with the token actually accepted"
    bm.free("a")
    assert bm.allocate("b", prompt(5)) == 0, "prompt 0..4 shares only the rejected draft"
    assert bm.allocate("c", prompt(3) + [50, 9]) == 4


def test_a_sequence_with_drafts_takes_nothing_else_until_accept_draft():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(3))
    bm.append_draft("a", [1, 2])
    before = bm.snapshot()
    for call in (lambda: bm.append_token("a", 1), lambda: bm.fork("a", "b"),
                 lambda: bm.append_draft("a", [1])):
        with pytest.raises(ValueError, match=r"2 draft token\(s\) await verification"):
            call()
    with pytest.raises(ValueError, match=r"num_accepted must be an int in \[0, 2\]"):
        bm.accept_draft("a", 3)
    with pytest.raises(ValueError, match="num_accepted"):
        bm.accept_draft("a", True)
    assert bm.snapshot() == before


def test_a_draft_waits_for_a_pending_token_and_refuses_bad_ids_before_changing_anything():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(3))
    bm.append_token("a", None)
    before = bm.snapshot()
    with pytest.raises(ValueError, match="pending"):
        bm.append_draft("a", [1])
    bm.set_token("a", 3)
    before = bm.snapshot()
    with pytest.raises(TypeError, match=r"draft_token_ids\[1\]"):
        bm.append_draft("a", [1, 2.5])
    with pytest.raises(TypeError, match="list of ints"):
        bm.append_draft("a", 7)
    assert bm.snapshot() == before


def test_out_of_blocks_on_append_draft_changes_nothing_and_can_append_draft_predicts_it():
    bm = BlockManager(3, BS)
    bm.allocate("a", prompt(6))
    assert bm.can_append_draft("a", 6) and not bm.can_append_draft("a", 7)
    before = bm.snapshot()
    with pytest.raises(OutOfBlocks, match=r"append_draft\('a', 7 tokens\) needs 2"):
        bm.append_draft("a", prompt(7))
    assert bm.snapshot() == before


def test_drafts_into_a_shared_partial_block_copy_it_first():
    bm = BlockManager(8, BS)
    bm.allocate("a", prompt(6))
    bm.fork("a", "b")
    shared = bm.block_table("a")[1]
    copies = bm.append_draft("b", [7, 8, 9])
    assert len(copies) == 1 and copies[0][0] == shared and bm.ref_count(shared) == 1
    bm.accept_draft("b", 0)
    assert bm.block_table("b")[1] == copies[0][1], "the copy stays: it holds the kept tokens"
    assert bm.block_table("a")[1] == shared


def test_thousands_of_rollbacks_leak_no_block():
    for caching in (True, False):
        bm = BlockManager(6, BS, enable_prefix_caching=caching)
        bm.allocate("a", prompt(5))
        for step in range(2000):
            k = 1 + step % 7
            bm.append_draft("a", [step % 3] * k)
            bm.accept_draft("a", step % (k + 1))
            bm.append_token("a", 1)
            if bm.num_tokens("a") > 12:
                bm.free("a")
                bm.allocate("a", prompt(5))
        bm.free("a")
        assert bm.stats.blocks_in_use == 0 and bm.num_free_blocks == 6
