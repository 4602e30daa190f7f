"""BlockManager: allocation, reference counts, prefix caching and LRU eviction, without a model."""

import pytest

from cudaformers.engine import block_manager as bm_mod
from cudaformers.engine.block_manager import BlockManager
from cudaformers.engine.sampling_params import SamplingParams
from cudaformers.engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def computed(bm, s, n=None):
    """Admit ``s`` with its prefix hits, allocate and mark ``n`` (default: all) tokens computed."""
    hits = bm.prefix_hits(s)
    bm.admit(s, hits)
    todo = (len(s) if n is None else n) - s.num_computed_tokens
    bm.allocate(s, todo)
    s.num_computed_tokens += todo
    bm.register(s)
    return hits


def test_allocate_and_free_leave_no_block_behind():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(10), "a"), seq(range(100, 103), "b")
    computed(bm, a)
    computed(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert bm.num_free_blocks == 4
    assert not bm.can_append(a, 4 * 5)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants()
    with pytest.raises(RuntimeError, match="scheduler bug"):
        bm.allocate(seq(range(40)), 40)


def test_prefix_hits_share_full_blocks_and_leave_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(1, 11), "a")  # 10 tokens: 2 full blocks + 2
    computed(bm, a)
    b = seq(list(range(1, 9)) + [50, 51, 52], "b")  # shares the first 2 full blocks
    hits = computed(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_prefix_hit_tokens == 8
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    # A prompt made only of cached full blocks still computes its last block (its logits are needed).
    c = seq(range(1, 9), "c")
    assert computed(bm, c) == a.block_table[:1]
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_different_prefix_same_block_tokens_does_not_hit():
    bm = BlockManager(num_blocks=16, block_size=4)
    computed(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    other = seq([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")  # block 2 equal, block 1 not: chained hash differs
    assert bm.prefix_hits(other) == []


def test_hash_collision_is_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(bm_mod, "chain_hash", lambda prev, toks: 42)
    bm = BlockManager(num_blocks=8, block_size=2)
    computed(bm, seq([1, 2, 3], "a"))
    assert bm.prefix_hits(seq([5, 6, 7], "b")) == []
    assert len(bm.prefix_hits(seq([1, 2, 9], "c"))) == 1


def test_freed_blocks_keep_their_hash_until_evicted_least_recent_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")  # blocks: [1,2] [3,4] [5]
    computed(bm, a)
    old = seq([7, 8, 9], "old")
    computed(bm, old)
    bm.free(old)  # freed first: its cached block is the oldest
    bm.free(a)
    assert bm.num_free_blocks == 6
    # A new prompt with a's prefix still hits after a is gone.
    again = seq([1, 2, 3, 4, 6], "again")
    assert len(bm.prefix_hits(again)) == 2
    # Taking 4 fresh blocks uses the unhashed ones first, then evicts old's block before a's.
    filler = seq(range(100, 108), "filler")
    computed(bm, filler)
    assert bm.prefix_hits(seq([7, 8, 9], "x")) == []
    assert len(bm.prefix_hits(again)) == 2
    bm.check_invariants()


def test_tail_blocks_are_evicted_before_the_prefix_they_extend():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5, 6, 7], "a")  # three full blocks + 1
    computed(bm, a)
    bm.free(a)
    computed(bm, seq([50, 51, 52], "b"))  # needs 2 blocks: the unhashed one, then a's last full block
    assert len(bm.prefix_hits(seq([1, 2, 3, 4, 5, 6, 0], "c"))) == 2


def test_prefix_caching_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    computed(bm, seq([1, 2, 3, 4, 5], "a"))
    assert bm.prefix_hits(seq([1, 2, 3, 4, 5], "b")) == []
    assert bm.cached == {}


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3], "a")
    computed(bm, a)
    b = seq([4, 5, 6], "b")
    computed(bm, b)
    bm.free(b)
    bm.reset_prefix_cache()
    assert bm.prefix_hits(seq([4, 5, 0], "c")) == []
    assert len(bm.prefix_hits(seq([1, 2, 0], "d"))) == 1
    bm.check_invariants()
