"""generate() against transformers: greedy tokens, batching with left padding, processors, sampling."""

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM, GenerationConfig
from cudaformers.generation.logits import SamplingTensors, warp


def _models(name):
    folder = tiny.checkpoint(name)
    return AutoModelForCausalLM.from_pretrained(folder), tiny.hf_model(folder)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral_window", "llama3_rope", "yarn_rope"])
def test_greedy_tokens_match_transformers(name):
    ours, ref = _models(name)
    ids = torch.randint(3, 211, (1, 11), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=32, do_sample=False, eos_token_id=None)  # no early stop: 32 tokens compared
    got = ours.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    assert got.shape == (1, 43)
    assert torch.equal(got, want)


def test_left_padded_batch_equals_each_row_alone_and_transformers():
    ours, ref = _models("qwen3")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 211, (n,), generator=g) for n in (5, 13, 9)]
    width = 13
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    kw = dict(max_new_tokens=24, eos_token_id=None)
    batched = ours.generate(ids, attention_mask=mask, **kw)
    for i, p in enumerate(prompts):
        alone = ours.generate(p[None], **kw)
        assert torch.equal(batched[i, width:], alone[0, len(p):])
    assert torch.equal(batched, ref.generate(ids, attention_mask=mask, **kw))


def test_eos_stops_and_pads_like_transformers():
    ours, ref = _models("llama")
    ids = torch.randint(3, 211, (2, 6), generator=torch.Generator().manual_seed(6))
    first = ours.generate(ids, max_new_tokens=8, eos_token_id=None)[:, 6:]
    eos = [int(first[0, 2]), int(first[1, 5])]  # force rows to end at different steps
    kw = dict(max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def test_repetition_penalty_and_min_new_tokens_match_transformers():
    ours, ref = _models("qwen2")
    ids = torch.randint(3, 211, (1, 9), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=20, repetition_penalty=1.7, min_new_tokens=5, eos_token_id=[2, 5])
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def test_generation_config_object_and_defaults():
    ours, _ = _models("llama")
    ids = torch.randint(3, 211, (1, 4))
    out = ours.generate(ids, generation_config=GenerationConfig(max_new_tokens=3, eos_token_id=None))
    assert out.shape == (1, 7)
    assert ours.generate(ids, eos_token_id=None).shape == (1, 20)  # transformers' max_length=20 default


def test_seeded_sampling_is_reproducible_and_num_return_sequences():
    ours, _ = _models("llama")
    ids = torch.randint(3, 211, (1, 5))
    kw = dict(do_sample=True, temperature=1.3, top_k=20, top_p=0.9, max_new_tokens=16, seed=11,
              num_return_sequences=3, eos_token_id=None)
    a, b = ours.generate(ids, **kw), ours.generate(ids, **kw)
    assert a.shape == (3, 21) and torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # rows draw independently


def test_bad_arguments_are_errors():
    ours, _ = _models("llama")
    ids = torch.randint(3, 211, (1, 4))
    with pytest.raises(TypeError, match="unsupported arguments"):
        ours.generate(ids, max_new_tokns=3)
    with pytest.raises(ValueError, match="top_p"):
        ours.generate(ids, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        ours.generate(ids, stop_strings=["x"])


@pytest.mark.parametrize("k,p,m", [(5, 1.0, None), (0, 0.7, None), (0, 1.0, 0.2), (7, 0.8, 0.05)])
def test_warpers_match_transformers(k, p, m):
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(8)) * 3
    want = logits / 0.7
    if k:
        want = TopKLogitsWarper(k)(None, want)
    if p < 1:
        want = TopPLogitsWarper(p)(None, want)
    if m:
        want = MinPLogitsWarper(m)(None, want)
    st = SamplingTensors.build([dict(temperature=0.7, top_k=k, top_p=p, min_p=m)] * 4, "cpu")
    got = warp(logits, st)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_sampling_follows_the_distribution():
    from cudaformers.generation.logits import sample

    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().expand(20000, 3).clone()
    st = SamplingTensors.build([dict(temperature=1.0)] * 20000, "cpu")
    tokens = sample(logits, st, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_successive_calls_reset_the_loop_state_and_match_transformers():
    """The decode loop's buffers are kept per (batch, capacity, sampling kind) and reused: a call
    after others with other eos / pad / min_new_tokens / lengths must still equal transformers."""
    ours, ref = _models("qwen3")
    ids = torch.randint(3, 211, (2, 9), generator=torch.Generator().manual_seed(8))
    probe = ref.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    stop = int(probe[0, 9 + 4])
    calls = [dict(max_new_tokens=20, eos_token_id=None),
             dict(max_new_tokens=20, eos_token_id=stop, pad_token_id=7),
             dict(max_new_tokens=20, eos_token_id=[stop, 5], pad_token_id=1, min_new_tokens=8),
             dict(max_new_tokens=12, eos_token_id=stop, pad_token_id=2),
             dict(max_new_tokens=20, eos_token_id=None)]
    for kw in calls:
        assert torch.equal(ours.generate(ids, do_sample=False, **kw), ref.generate(ids, do_sample=False, **kw)), kw
