"""Random allocate / append / draft / accept / fork / free programs against the block manager.

Beside the manager the machine keeps a model of physical memory: which token each slot holds.
It writes every token the manager says must be computed, applies the copy-on-write copies it
returns, and after every step reads each sequence back through its block table. So a wrong prefix
hit, a missed copy or a block freed too early shows up as a sequence reading someone else's
tokens, not only as a broken count. A rejected draft token's slot keeps its KV until overwritten:
the machine writes REJECTED there, so a block sealed with a rejected token is caught in the cache.
"""
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.kvcache import BlockManager, OutOfBlocks

BS = 4
NUM_BLOCKS = 10
REJECTED = -1  # what a rejected draft token's slot holds (stale KV) until overwritten
# Few token values and shared prompt starts, so that prefix hits and collisions are common.
PREFIXES = [[], [1, 1, 1, 1], [1, 1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 1, 1, 1, 1]]
SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class BlockManagerMachine(RuleBasedStateMachine):
    caching = True
    hash_fn = None

    def __init__(self):
        super().__init__()
        kwargs = {"hash_fn": self.hash_fn} if self.hash_fn else {}
        self.bm = BlockManager(NUM_BLOCKS, BS, self.caching, **kwargs)
        self.tokens: dict[int, list[int]] = {}           # what each sequence should read
        self.memory = [[None] * BS for _ in range(NUM_BLOCKS)]  # what each slot holds
        self.next_id = 0
        self.drafts: dict[int, int] = {}                 # sequences awaiting verification

    def _write(self, seq_id, pos, token):
        block = self.bm.block_table(seq_id)[pos // BS]
        self.memory[block][pos % BS] = token

    def _read(self, seq_id, pos):
        return self.memory[self.bm.block_table(seq_id)[pos // BS]][pos % BS]

    def _pick(self, data, with_drafts=None):
        ids = [s for s in sorted(self.tokens) if with_drafts is None or
               bool(self.drafts.get(s)) == with_drafts]
        return data.draw(st.sampled_from(ids))

    def _refused(self, op, seq_id, *args):
        before = self.bm.snapshot()
        with pytest.raises(ValueError, match="accept_draft"):
            op(seq_id, *args)
        assert self.bm.snapshot() == before, f"a refused {op.__name__} changed the manager"

    # ------------------------------------------------------------------ rules
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=7))
    def allocate(self, prefix, suffix):
        prompt = (prefix + suffix) or [0]
        seq_id, self.next_id = self.next_id, self.next_id + 1
        before = self.bm.snapshot()
        try:
            cached = self.bm.allocate(seq_id, prompt)
        except OutOfBlocks:
            assert self.bm.snapshot() == before, "a failed allocate changed the manager"
            return
        assert cached % BS == 0 and 0 <= cached < len(prompt), \
            f"cached {cached} must be whole blocks and leave a token to compute of {len(prompt)}"
        assert self.caching or cached == 0, "a hit with prefix caching off"
        for pos in range(cached):
            assert self._read(seq_id, pos) == prompt[pos], \
                f"the prefix cache served a block holding other tokens at position {pos}"
        for pos in range(cached, len(prompt)):
            self._write(seq_id, pos, prompt[pos])
        self.tokens[seq_id] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        seq_id = self._pick(data)
        if self.drafts.get(seq_id):
            return self._refused(self.bm.append_token, seq_id, token)
        before = self.bm.snapshot()
        try:
            copies = self.bm.append_token(seq_id, token)
        except OutOfBlocks:
            assert self.bm.snapshot() == before, "a failed append_token changed the manager"
            return
        for src, dst in copies:
            self.memory[dst] = list(self.memory[src])
        last = self.bm.block_table(seq_id)[-1]
        assert self.bm.ref_count(last) == 1, \
            f"sequence {seq_id} is about to write into block {last}, shared by others"
        self._write(seq_id, len(self.tokens[seq_id]), token)
        self.tokens[seq_id].append(token)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        child, self.next_id = self.next_id, self.next_id + 1
        if self.drafts.get(parent):
            return self._refused(self.bm.fork, parent, child)
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = self._pick(data)
        self.bm.free(seq_id)
        del self.tokens[seq_id]
        self.drafts.pop(seq_id, None)

    @precondition(lambda self: self.tokens)
    @rule()
    def free_everything(self):
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        self.tokens.clear()
        self.drafts.clear()

    @precondition(lambda self: len(self.drafts) < len(self.tokens))
    @rule(data=st.data(), draft=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append_draft(self, data, draft):
        seq_id = self._pick(data, with_drafts=False)
        before = self.bm.snapshot()
        try:
            copies = self.bm.append_draft(seq_id, draft)
        except OutOfBlocks:
            assert self.bm.snapshot() == before, "a failed append_draft changed the manager"
            return
        for src, dst in copies:
            self.memory[dst] = list(self.memory[src])
        n = len(self.tokens[seq_id])
        for pos, token in enumerate(draft, n):  # the verify step writes every draft's KV
            block = self.bm.block_table(seq_id)[pos // BS]
            assert self.bm.ref_count(block) == 1, f"draft KV written into shared block {block}"
            self._write(seq_id, pos, token)
        self.tokens[seq_id] += draft
        self.drafts[seq_id] = len(draft)

    @precondition(lambda self: self.drafts)
    @rule(data=st.data())
    def accept_draft(self, data):
        seq_id = self._pick(data, with_drafts=True)
        k = self.drafts.pop(seq_id)
        accepted = data.draw(st.integers(0, k))
        end = len(self.tokens[seq_id]) - k + accepted
        for pos in range(end, len(self.tokens[seq_id])):
            self._write(seq_id, pos, REJECTED)
        self.bm.accept_draft(seq_id, accepted)
        del self.tokens[seq_id][end:]

    # ------------------------------------------------------------------ invariants
    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, toks in self.tokens.items():
            assert self.bm.num_tokens(seq_id) == len(toks)
            assert len(self.bm.block_table(seq_id)) == -(-len(toks) // BS), \
                "a sequence of n tokens holds ceil(n / block_size) blocks"
            got = [self._read(seq_id, p) for p in range(len(toks))]
            assert got == toks, f"sequence {seq_id} reads {got} through its table, wrote {toks}"

    @invariant()
    def ref_count_is_the_number_of_tables_holding_the_block(self):
        holders = [0] * NUM_BLOCKS
        for seq_id in self.tokens:
            table = self.bm.block_table(seq_id)
            assert len(set(table)) == len(table), f"sequence {seq_id} holds a block twice"
            for b in table:
                holders[b] += 1
        assert [self.bm.ref_count(b) for b in range(NUM_BLOCKS)] == holders

    @invariant()
    def a_block_is_shared_only_as_the_same_prefix_of_every_holder(self):
        where: dict[int, list[tuple[int, int]]] = {}
        for seq_id in self.tokens:
            for i, b in enumerate(self.bm.block_table(seq_id)):
                where.setdefault(b, []).append((seq_id, i))
        for b, places in where.items():
            if len(places) < 2:
                continue
            indexes = {i for _, i in places}
            assert len(indexes) == 1, f"block {b} sits at different positions {places}"
            end = (indexes.pop() + 1) * BS
            prefixes = {tuple(self.tokens[s][:end]) for s, _ in places}
            assert len(prefixes) == 1, f"block {b} is shared by sequences with different prefixes"
            fills = {min(len(self.tokens[s]), end) for s, _ in places}
            assert fills == {end} or len({len(self.tokens[s]) for s, _ in places}) == 1, \
                f"partly filled block {b} is shared by sequences that have diverged (no CoW)"

    @invariant()
    def blocks_in_use_cached_and_free_add_up(self):
        s = self.bm.stats
        in_use = sum(1 for b in range(NUM_BLOCKS) if self.bm.ref_count(b) > 0)
        assert s.blocks_in_use == in_use
        assert s.blocks_in_use + s.blocks_cached + s.blocks_free == NUM_BLOCKS
        assert self.bm.num_free_blocks == s.blocks_cached + s.blocks_free
        if not self.caching:
            assert s.blocks_cached == 0 and s.hits == 0

    @invariant()
    def no_cached_block_holds_a_draft_or_rejected_token(self):
        for seq_id, k in self.drafts.items():
            n = len(self.tokens[seq_id])
            for b in self.bm.block_table(seq_id)[(n - k) // BS:]:
                assert not self.bm.is_cached(b), f"block {b} holding a draft token was sealed"
        for b in range(NUM_BLOCKS):
            if self.bm.is_cached(b):
                assert REJECTED not in self.memory[b], \
                    f"cached block {b} holds a rejected draft token: {self.memory[b]}"

    @invariant()
    def with_nothing_running_nothing_is_in_use(self):
        if not self.tokens:
            s = self.bm.stats
            assert s.blocks_in_use == 0
            if not self.caching:
                assert s.blocks_free == NUM_BLOCKS, "with caching off every block is free again"


class WithoutPrefixCaching(BlockManagerMachine):
    caching = False


class WithCollidingHashes(BlockManagerMachine):
    """A hash that sees only a block's first two tokens and not its parent: collisions galore,
    which the stored keys must catch."""

    @staticmethod
    def hash_fn(parent, tokens):
        return tokens[:16]


TestWithPrefixCaching = BlockManagerMachine.TestCase
TestWithoutPrefixCaching = WithoutPrefixCaching.TestCase
TestWithCollidingHashes = WithCollidingHashes.TestCase
TestWithPrefixCaching.settings = SETTINGS
TestWithoutPrefixCaching.settings = SETTINGS
TestWithCollidingHashes.settings = SETTINGS
