"""BlockManager: hands out the paged KV cache's blocks and shares full blocks between requests.

The cache is ``num_blocks`` blocks of ``block_size`` tokens. A sequence's ``block_table`` lists its
blocks in token order. Prefix caching: once a block is full and its keys/values are scheduled, it
is filed under a chained hash of its tokens (the hash of the previous block and its own token ids),
so a later request whose prompt starts with the same tokens reuses it instead of recomputing.
Blocks are reference counted. A block whose count drops to zero keeps its hash and joins the free
list; allocation takes the least recently freed block first, so cached prefixes survive as long as
memory allows. Blocks without a hash are reused before any cached one.
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import PLACEHOLDER, Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to verify a hash hit token by token


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front: next out
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.num_hit_tokens = 0  # totals, for metrics
        self.num_queried_tokens = 0

    # -- accounting -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must add to hold ``num_new_tokens`` more computed tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    # -- hashing ----------------------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` over every full block whose tokens are all known."""
        bs, toks = self.block_size, seq.token_ids
        while (len(seq.block_hashes) + 1) * bs <= len(toks):
            i = len(seq.block_hashes)
            block = tuple(toks[i * bs:(i + 1) * bs])
            if PLACEHOLDER in block:
                return
            seq.block_hashes.append(chain_hash(seq.block_hashes[-1] if i else None, block))

    def _lookup(self, h: int, token_ids: tuple[int, ...]) -> int | None:
        bid = self.cached.get(h)
        if bid is not None and self.blocks[bid].token_ids == token_ids:
            return bid
        return None

    # -- admission --------------------------------------------------------------------------------
    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the start of a new sequence's tokens.

        The last token is always left to compute (its logits are needed), so a prompt that is all
        full blocks leaves its last block out.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        self.update_hashes(seq)
        bs = self.block_size
        hits = []
        for i in range(min(len(seq.block_hashes), (len(seq) - 1) // bs)):
            bid = self._lookup(seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if bid is None:
                break
            hits.append(bid)
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        # Hit blocks sitting in the free list leave it when taken.
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return need + reclaimed <= len(self._free)

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give a new sequence its prefix-cache hits (the caller then ``allocate``s the rest)."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        for bid in hits:
            self._take(bid)
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_prefix_hit_tokens = seq.num_computed_tokens
        self.num_hit_tokens += seq.num_computed_tokens
        self.num_queried_tokens += len(seq)

    # -- growth and release -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Add the blocks for ``num_new_tokens`` more computed tokens (check ``can_append`` first)."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > len(self._free):
            raise RuntimeError(f"{seq} needs {n} blocks, {len(self._free)} are free (scheduler bug)")
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:  # evict the cached prefix this block held
                if self.cached.get(block.hash) == bid:
                    del self.cached[block.hash]
                block.hash = block.token_ids = None
            block.ref_count = 1
            seq.block_table.append(bid)

    def register(self, seq: Sequence) -> None:
        """File the sequence's full, scheduled blocks under their hash (call after each step)."""
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= seq.num_cached_blocks:
            return  # no block filled since the last call: the common decode step
        self.update_hashes(seq)
        full = min(len(seq.block_hashes), seq.num_computed_tokens // bs, len(seq.block_table))
        # Blocks before num_cached_blocks were filed (or were hits) already: each step looks at new ones only.
        for i in range(seq.num_cached_blocks, full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self.cached:  # a concurrent duplicate stays unfiled
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.cached[h] = block.block_id
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (finished, cancelled or preempted)."""
        # Tail blocks first: a cached prefix is only useful from its start, so its end goes first.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                self._free[bid] = None
                if block.hash is None:
                    self._free.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (weights changed, or to measure without the cache)."""
        for block in self.blocks:
            if block.ref_count == 0:
                block.hash = block.token_ids = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}

    def check_invariants(self) -> None:
        """For tests: every block is either free (count 0) or referenced, never both."""
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in self._free), block.block_id
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h
