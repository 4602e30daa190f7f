"""generate()'s decode loop driver (``generation/loop.py``'s ``run_loop``): how it groups steps into the
runner's multi-step graphs between stop checks, with the tokens of one step at a time."""

import pytest
import torch

from cudaformers.generation import loop
from cudaformers.generation.logits import SamplingTensors

VOCAB = 11


def _run(max_new: int, chunk: int, eos: int = -1):
    """(tokens, the steps each ``step(n)`` call ran) of a greedy loop over seeded random logits."""
    kind = loop.LoopKind(sampling=False, top_k=False, top_p=False, min_p=False, penalty=False, min_new=False)
    state = loop.LoopState(kind, 1, max_new, VOCAB, "cpu")
    state.start(SamplingTensors.build([dict(temperature=0.0)], "cpu"), None, torch.tensor([eos]), 0, 0, max_new,
                torch.tensor([3]))
    g = torch.Generator().manual_seed(0)
    runs = []

    def step(n: int) -> None:
        runs.append(n)
        for _ in range(n):
            loop.advance(torch.randn(1, VOCAB, generator=g), state)

    return loop.run_loop(torch.randn(1, VOCAB, generator=g), step, state, max_new, chunk=chunk), runs


@pytest.mark.parametrize("chunk", [2, 4, 8])
@pytest.mark.parametrize("max_new", [1, 2, 7, 8, 9, 17, 30])
def test_chunks_stay_between_stop_checks_and_give_the_same_tokens(max_new, chunk):
    want, singles = _run(max_new, 1)
    got, runs = _run(max_new, chunk)
    assert torch.equal(got, want) and set(singles) <= {1} and sum(runs) == max_new - 1
    done = 1
    for n in runs:
        assert n in (1, chunk)
        assert all(m % loop.SYNC_EVERY for m in range(done + 1, done + n))  # no stop check skipped
        done += n
    # Single steps only up to the first stop check and at the end: every other step is in a chunk.
    assert runs.count(1) <= (loop.SYNC_EVERY - 1) + (chunk - 1)


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_row_that_finishes_stops_the_loop_at_the_same_check(chunk):
    probe, _ = _run(30, 1)
    eos = int(probe[0, 10])
    first = int((probe[0] == eos).nonzero()[0])  # the step that first emits it
    want, _ = _run(30, 1, eos)
    got, runs = _run(30, chunk, eos)
    assert torch.equal(got, want) and got.shape[1] == first + 1
    # On the CPU the check reads at once: the loop ends at the first check past that step.
    assert sum(runs) + 1 == (first // loop.SYNC_EVERY + 1) * loop.SYNC_EVERY
