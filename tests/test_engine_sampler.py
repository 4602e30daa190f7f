"""Engine sampler: per-row params against transformers' processors, seeds per row, exact draws."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from cudaformers.engine.sampler import Sampler, SamplingBatch, draw
from cudaformers.engine.sampling_params import SamplingParams


def batch(params, histories=None, num_outputs=None, generators=None):
    n = len(params)
    return SamplingBatch.build(params, histories, num_outputs or [0] * n, generators or [None] * n, lambda t: t)


def test_greedy_rows_with_penalty_match_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    hist = [[1, 2, 3, 40], [7], [5, 5, 9, 11, 12]]
    params = [SamplingParams(temperature=0, repetition_penalty=p) for p in (1.3, 1.0, 0.7)]
    tokens, _ = Sampler()(logits, batch(params, hist))
    for i, (p, h) in enumerate(zip(params, hist)):
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([h]), logits[i:i + 1].clone())
        assert tokens[i].item() == want.argmax().item()


def test_top_k_one_is_greedy_and_mixed_rows_keep_their_mode():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0),
              SamplingParams(temperature=2.0, top_p=1e-6), SamplingParams(temperature=1.0, min_p=1.0)]
    tokens, _ = Sampler()(logits, batch(params))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_seeded_rows_draw_the_same_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    sp = SamplingParams(temperature=1.0, seed=5)
    alone = Sampler()(logits[1:2], batch([sp], generators=[torch.Generator().manual_seed(5)]))[0]
    params = [SamplingParams(temperature=1.0), sp, SamplingParams(temperature=0.5)]
    gens = [None, torch.Generator().manual_seed(5), None]
    together = Sampler()(logits, batch(params, generators=gens))[0]
    assert together[1] == alone[0]


def test_draw_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(20000, 1)
    torch.manual_seed(0)
    freq = torch.bincount(draw(probs, []), minlength=4).float() / 20000
    assert torch.allclose(freq, probs[0], atol=0.015)


def test_min_tokens_bans_finish_tokens_until_reached():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 10.0
    sp = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    tokens, _ = Sampler()(logits, batch([sp, sp], num_outputs=[1, 2]))
    assert tokens.tolist()[0] != 3 and tokens.tolist()[1] == 3


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_raw_log_softmax(k):
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0, logprobs=k), SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    tokens, (chosen, top_ids, top_lp) = Sampler()(logits, batch(params, [[1], [int(logits[1].argmax())]]))
    ref = logits.log_softmax(-1)
    assert torch.allclose(chosen, ref.gather(1, tokens[:, None])[:, 0])
    assert top_ids.shape == (2, k) and torch.allclose(top_lp, ref.topk(k, -1).values if k else ref[:, :0])
