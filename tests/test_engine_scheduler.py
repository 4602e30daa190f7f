"""Scheduler: token budget, chunked prefill mixed with decodes, FCFS admission, preemption,
rejection and cancellation, driven by a fake sampler (no model, no tensors)."""

import random

import pytest

from cudaformers.engine.block_manager import BlockManager
from cudaformers.engine.sampling_params import SamplingParams
from cudaformers.engine.scheduler import InvalidRequestError, RequestTooLongError, Scheduler
from cudaformers.engine.sequence import PLACEHOLDER, FinishReason, Sequence


def make(num_blocks=64, block_size=4, max_batch_tokens=32, max_num_seqs=8, max_model_len=512, prefix=True):
    return Scheduler(BlockManager(num_blocks, block_size, prefix), max_batch_tokens, max_num_seqs, max_model_len)


def add(sched, n_prompt, max_tokens=5, rid=None, first=0):
    s = Sequence(rid or f"r{len(sched.waiting) + len(sched.running)}-{n_prompt}",
                 list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens))
    sched.add(s)
    return s


def run(sched, max_steps=10_000, on_step=None):
    """Schedule until done; each sampled token is a function of the sequence (as a model would be)."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return steps
        batch = sched.schedule()
        assert batch, "nothing scheduled while requests are pending"
        steps.append(batch)
        if on_step:
            on_step(batch)
        slots = sched.on_launched(batch)
        for i, slot in zip(batch.sample_indices, slots):
            seq = batch.seqs[i]
            assert seq.token_ids[slot] == PLACEHOLDER
            seq.token_ids[slot] = 1000 + (sum(seq.token_ids[:slot]) + slot) % 97
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
        sched.bm.check_invariants()
    raise AssertionError("did not finish")


def test_budget_and_max_num_seqs_hold_every_step():
    sched = make(max_batch_tokens=16, max_num_seqs=3)
    seqs = [add(sched, n) for n in (3, 40, 7, 1, 22, 9)]
    steps = run(sched)
    for b in steps:
        assert b.num_tokens <= 16 and len(b.seqs) <= 3
        assert len({s.seq_id for s in b.seqs}) == len(b.seqs)
    assert all(s.num_output_tokens == 5 and s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert sched.bm.num_free_blocks == sched.bm.num_blocks


def test_chunked_prefill_shares_steps_with_decodes():
    sched = make(max_batch_tokens=8)
    short = add(sched, 3, max_tokens=20)
    long = add(sched, 30)
    chunks, mixed = [], []

    def record(b):
        for i, (s, n) in enumerate(zip(b.seqs, b.num_new_tokens)):
            # A sequence samples only in the step that feeds its last token.
            assert (i in b.sample_indices) == (s.num_computed_tokens + n == len(s))
            if s is long and s.num_output_tokens == 0:
                chunks.append(n)
                if short in b.seqs:
                    mixed.append(n)
    run(sched, on_step=record)
    assert sum(chunks) == 30 and max(chunks) <= 8 and len(chunks) >= 4
    assert any(n > 1 for n in mixed)  # prefill chunks ran beside the short request's decodes


def test_admission_is_first_come_first_served():
    sched = make(num_blocks=20, max_batch_tokens=64, max_num_seqs=4)
    seqs = [add(sched, n, max_tokens=3) for n in (30, 2, 25, 3, 40, 1, 2)]
    order = []

    def record(batch):
        order.extend(s.request_id for s in batch.seqs if s.request_id not in order)
    run(sched, on_step=record)
    assert order == [s.request_id for s in seqs]


def test_preemption_frees_the_newest_and_everything_completes():
    # 12 blocks of 4 tokens: three requests that grow to 6 blocks each cannot all stay resident.
    sched = make(num_blocks=12, max_batch_tokens=64, max_num_seqs=8, prefix=False)
    seqs = [add(sched, 10, max_tokens=14, first=100 * i) for i in range(3)]
    preempted = []
    run(sched, on_step=lambda b: preempted.extend(b.preempted))
    assert preempted and sched.num_preemptions == len(preempted)
    assert preempted[0] is seqs[-1]  # the newest goes first
    assert all(s.num_output_tokens == 14 for s in seqs)
    assert sched.bm.num_free_blocks == 12


def test_preempted_sequence_recomputes_prompt_and_outputs():
    sched = make(num_blocks=6, block_size=4, max_batch_tokens=64, prefix=False)
    a = add(sched, 8, max_tokens=8, first=0)
    b = add(sched, 8, max_tokens=8, first=50)
    seen = {}

    def check(batch):
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            if s.num_preemptions and s.seq_id not in seen and s.num_computed_tokens == 0:
                seen[s.seq_id] = (n, len(s))
    run(sched, on_step=check)
    assert seen, "no preemption happened"
    for n, length in seen.values():
        assert n == length and length > 8  # prompt and the outputs so far, in one prefill
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_requests_that_can_never_fit_are_rejected():
    sched = make(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(RequestTooLongError, match="context holds 64"):
        add(sched, 64)
    with pytest.raises(RequestTooLongError, match="KV cache has 8 blocks"):
        add(sched, 30, max_tokens=10)  # 40 tokens > 32 slots
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        add(sched, 0)
    add(sched, 30, max_tokens=2)  # exactly 32: fits


def test_cancel_waiting_and_running_leaks_nothing():
    sched = make(num_blocks=16, max_batch_tokens=8, max_num_seqs=2)
    seqs = [add(sched, n, max_tokens=50) for n in (9, 5, 7, 12)]
    for _ in range(3):
        b = sched.schedule()
        sched.on_launched(b)
        for i, slot in zip(b.sample_indices, [len(b.seqs[i]) - 1 for i in b.sample_indices]):
            b.seqs[i].token_ids[slot] = 7
    assert sched.running and sched.waiting
    for s in seqs:
        sched.finish(s, FinishReason.ABORT)
    assert not sched.has_unfinished
    assert sched.bm.num_free_blocks == 16
    sched.bm.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_finish_without_leaks(seed):
    rng = random.Random(seed)
    sched = make(num_blocks=rng.randint(16, 40), block_size=rng.choice([1, 2, 4, 16 // 2]),
                 max_batch_tokens=rng.randint(4, 48), max_num_seqs=rng.randint(1, 6))
    seqs = []
    for i in range(12):
        try:
            seqs.append(add(sched, rng.randint(1, 30), max_tokens=rng.randint(1, 12), first=rng.choice([0, 7 * i])))
        except RequestTooLongError:
            pass
    run(sched)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
