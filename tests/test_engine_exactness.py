"""The engine's greedy tokens equal generate()'s for every request, whatever the batch looks like:
mixed lengths, chunked prefill, preemption forced by a tiny block pool, prefix-cache hits, with
and without async batching (fp32, CPU, tiny random checkpoints)."""

import functools

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM
from cudaformers.engine.llm_engine import LLMEngine
from cudaformers.engine.sampling_params import SamplingParams


@functools.lru_cache(maxsize=None)
def model(name="qwen3"):
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name))


@functools.lru_cache(maxsize=None)
def reference(name, prompt: tuple, n: int, penalty: float = 1.0) -> list[int]:
    out = model(name).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                               repetition_penalty=penalty)
    return out[0, len(prompt):].tolist()


def prompts(lengths, seed=0, shared_prefix=None):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, 211, (n,), generator=g).tolist() for n in lengths]
    if shared_prefix:
        out = [shared_prefix + p for p in out]
    return out


def run(engine, ps, max_tokens, stagger=False, **sp):
    """Run prompts to the end; ``stagger``: the first one gets a step ahead (its blocks get cached)."""
    ids = []
    for i, p in enumerate(ps):
        ids.append(engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sp)))
        if stagger and i == 0:
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return [engine.requests[i] for i in ids]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("case", ["mixed", "chunked", "preempt", "prefix"])
def test_greedy_matches_generate(case, use_async):
    name = "qwen3"
    kw = dict(num_blocks=128, block_size=4, max_batch_tokens=64, max_num_seqs=8)
    ps = prompts([5, 23, 1, 12, 40, 9, 17])
    if case == "chunked":
        kw["max_batch_tokens"] = 7  # prompts arrive in chunks beside other requests' decodes
    elif case == "preempt":
        kw["num_blocks"] = 20  # 80 slots for ~7 x 40 tokens: requests must be preempted
    elif case == "prefix":
        ps = prompts([3, 11, 6, 20], seed=1, shared_prefix=prompts([13], seed=2)[0])
        ps += [ps[1][:-2]]  # a prompt ending inside another's cached blocks
    engine = LLMEngine(model(name), use_async_batching=use_async, **kw)
    seqs = run(engine, ps, max_tokens=24, stagger=case == "prefix")
    for p, s in zip(ps, seqs):
        assert s.output_token_ids == reference(name, tuple(p), 24), (case, s)
        assert s.finish_reason.value == "length"
    stats = engine.stats()
    if case == "preempt":
        assert stats["preemptions"] > 0
    if case == "prefix":
        assert sum(s.num_prefix_hit_tokens for s in seqs) >= 3 * 12


@pytest.mark.parametrize("name", ["llama", "mistral_window"])
def test_other_families_match_transformers(name):
    ps = prompts([7, 19, 3], seed=3)
    engine = LLMEngine(model(name), num_blocks=64, block_size=4, max_batch_tokens=9)
    seqs = run(engine, ps, max_tokens=16)
    ref = tiny.hf_model(tiny.checkpoint(name))
    for p, s in zip(ps, seqs):
        want = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(p):]
        assert s.output_token_ids == want.tolist()


@pytest.mark.parametrize("use_async", [False, True])
def test_stop_token_ends_a_request_where_generate_would(use_async):
    ps = prompts([6, 14, 10], seed=4)
    refs = [reference("qwen3", tuple(p), 20) for p in ps]
    stop = refs[0][6]
    engine = LLMEngine(model(), num_blocks=64, block_size=4, use_async_batching=use_async)
    seqs = run(engine, ps, max_tokens=20, stop_token_ids=[stop])
    for s, ref in zip(seqs, refs):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert s.output_token_ids == ref[:cut]
        assert s.finish_reason.value == ("stop" if stop in ref else "length")


def test_min_tokens_masks_the_stop_token():
    p = prompts([6], seed=4)[0]
    ref = reference("qwen3", tuple(p), 20)
    engine = LLMEngine(model(), num_blocks=64, block_size=4)
    [s] = run(engine, [p], max_tokens=20, stop_token_ids=[ref[0]], min_tokens=3)
    assert ref[0] not in s.output_token_ids[:3] and s.output_token_ids[0] != ref[0]


@pytest.mark.parametrize("use_async", [False, True])
def test_repetition_penalty_matches_generate(use_async):
    ps = prompts([4, 15], seed=5)
    engine = LLMEngine(model(), num_blocks=64, block_size=4, use_async_batching=use_async)
    seqs = run(engine, ps, max_tokens=16, repetition_penalty=1.5)
    for p, s in zip(ps, seqs):
        assert s.output_token_ids == reference("qwen3", tuple(p), 16, 1.5)


def test_logprobs_are_the_models_log_softmax():
    m = model()
    p = prompts([9], seed=6)[0]
    engine = LLMEngine(m, num_blocks=64, block_size=4)
    [s] = run(engine, [p], max_tokens=5, logprobs=3)
    full = torch.tensor([p + s.output_token_ids[:-1]])
    with torch.no_grad():
        lp = m(full).logits[0, len(p) - 1:].log_softmax(-1)
    for i, (tok, entry) in enumerate(zip(s.output_token_ids, s.logprobs)):
        top = lp[i].topk(3)
        assert set(entry) == set(top.indices.tolist()) | {tok}
        assert entry[tok] == pytest.approx(lp[i, tok].item(), abs=1e-4)


def test_seeded_sampling_does_not_depend_on_the_batch():
    m = model()
    p = prompts([8], seed=7)[0]
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=123, max_tokens=12, ignore_eos=True)
    alone = LLMEngine(m, num_blocks=64, block_size=4)
    a = alone.requests[alone.add_request(p, sp)]
    while alone.has_unfinished_requests():
        alone.step()
    crowd = LLMEngine(m, num_blocks=64, block_size=4, use_async_batching=True)
    others = [crowd.add_request(q, SamplingParams(temperature=1.0, max_tokens=9)) for q in prompts([3, 17], seed=8)]
    b = crowd.requests[crowd.add_request(p, sp)]
    c = crowd.requests[crowd.add_request(p, SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True))]
    while crowd.has_unfinished_requests():
        crowd.step()
    assert others and a.output_token_ids == b.output_token_ids
    assert c.output_token_ids != a.output_token_ids


@pytest.mark.parametrize("use_async", [False, True])
def test_abort_mid_run_frees_every_block(use_async):
    engine = LLMEngine(model(), num_blocks=40, block_size=4, max_batch_tokens=8, use_async_batching=use_async)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
           for p in prompts([12, 5, 20, 9])]
    for _ in range(6):
        engine.step()
    for rid in ids[:3]:
        assert engine.abort_request(rid).finish_reason.value == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests[ids[3]].output_token_ids == reference("qwen3", tuple(prompts([12, 5, 20, 9])[3]), 30)
    assert engine.block_manager.num_free_blocks == 40
    engine.block_manager.check_invariants()


class _ReplayByRerun:
    """Stands in for a captured CUDA graph on the CPU: replay reruns the forward into the same
    output buffer, so the fixed-buffer bookkeeping (padding, pad block, block table width,
    placeholder fill) is exercised exactly as on the GPU."""

    def __init__(self, graphs, b):
        self.graphs, self.b = graphs, b

    def replay(self):
        self.graphs.outputs[self.b].copy_(self.graphs._forward(self.b))


@pytest.mark.parametrize("use_async", [False, True])
def test_decode_graph_buffers_give_the_same_tokens(use_async):
    from cudaformers.engine.cuda_graph import DecodeGraphs

    engine = LLMEngine(model(), num_blocks=48, block_size=4, max_batch_tokens=16, max_num_seqs=6,
                       use_async_batching=use_async)
    graphs = DecodeGraphs(engine.runner)
    for b in graphs.sizes:
        graphs.outputs[b] = graphs._forward(b).clone()
        graphs.graphs[b] = _ReplayByRerun(graphs, b)
    engine.runner.graphs = graphs
    replays = []
    original = graphs.replay
    graphs.replay = lambda b, batch, *a: replays.append((b, len(batch.seqs))) or original(b, batch, *a)
    ps = prompts([5, 23, 1, 12, 9, 3, 17], seed=9)
    seqs = run(engine, ps, max_tokens=20)
    for p, s in zip(ps, seqs):
        assert s.output_token_ids == reference("qwen3", tuple(p), 20)
    assert graphs.sizes == [1, 2, 4, 6]
    assert any(b > n for b, n in replays) and any(b == n for b, n in replays)  # padded and exact buckets


def test_triton_attention_mixed_steps_match_generate():
    # Chunked prefill beside decodes: the triton backend runs decode rows through its decode kernel
    # and the chunks through the prefill kernel (Triton's interpreter on CPU).
    folder = tiny.checkpoint("qwen3")
    triton_model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="triton")
    engine = LLMEngine(triton_model, num_blocks=64, block_size=4, max_batch_tokens=9, max_num_seqs=4)
    ps = prompts([6, 19, 3, 11], seed=5)
    outs = run(engine, ps, max_tokens=6)
    for p, out in zip(ps, outs):
        assert out.output_token_ids == reference("qwen3", tuple(p), 6)
