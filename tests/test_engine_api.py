"""User-facing entry points: SamplingParams checks, LLM.generate, generate_batch and the
continuous-batching manager (streaming, cancel, stop), stop strings."""

import functools

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM, GenerationConfig
from cudaformers.engine.continuous_batching import RequestStatus, generate_batch, init_continuous_batching
from cudaformers.engine.llm import LLM
from cudaformers.engine.sampling_params import SamplingParams, SamplingParamsError
from cudaformers.engine.scheduler import RequestTooLongError

ENGINE = dict(num_blocks=64, block_size=4, max_batch_tokens=32)


@functools.lru_cache(maxsize=None)
def model():
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"))


def greedy(prompt, n):
    return model().generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                            eos_token_id=None)[0, len(prompt):].tolist()


PROMPTS = [[5, 9, 13, 21, 8], list(range(30, 52)), [77]]


class CharTokenizer:
    """One letter per token id: enough to exercise stop strings."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)

    def encode(self, text):
        return [ord(c) - 97 for c in text]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=1.5),
                                 dict(repetition_penalty=0), dict(max_tokens=0), dict(logprobs=-1),
                                 dict(stop=[""]), dict(stop_token_ids=[-3]), dict(min_tokens=5, max_tokens=2)])
def test_sampling_params_reject_bad_values_by_name(bad):
    with pytest.raises(SamplingParamsError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_sampling_params_from_generation_config():
    sp = SamplingParams.from_generation_config(GenerationConfig(do_sample=True, temperature=0.7, top_k=0,
                                                                max_new_tokens=9, repetition_penalty=1.2))
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.repetition_penalty) == (0.7, -1, 9, 1.2)
    assert SamplingParams.from_generation_config(GenerationConfig(max_new_tokens=4)).greedy


def test_llm_generate_returns_outputs_in_prompt_order():
    llm = LLM(model(), **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [greedy(p, 10) for p in PROMPTS]
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(o.finish_reason == "length" and o.finished for o in outs)
    assert not llm.engine.requests  # released
    # One prompt, a params list, and a request that cannot fit (rejected before anything is queued).
    assert llm.generate(PROMPTS[0], [SamplingParams(temperature=0, max_tokens=3)])[0].token_ids == greedy(PROMPTS[0], 3)
    small = LLM(model(), **{**ENGINE, "num_blocks": 32})
    with pytest.raises(RequestTooLongError, match="KV cache has 32 blocks"):
        small.generate([PROMPTS[0], list(range(3, 103))], SamplingParams(max_tokens=100))
    assert not small.engine.has_unfinished_requests()


def test_llm_needs_a_tokenizer_for_text():
    with pytest.raises(Exception, match="tokenizer"):
        LLM(model(), **ENGINE).generate("hello")


def test_stop_strings_cut_the_text():
    p = PROMPTS[1]
    ref = greedy(p, 12)
    text = CharTokenizer().decode(ref)
    stop = text[4:6]
    llm = LLM(model(), tokenizer=CharTokenizer(), **ENGINE)
    [out] = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop=stop))
    assert out.text == text[:text.find(stop)] and out.finish_reason == "stop"
    assert out.token_ids == ref[:text.find(stop) + len(stop)]


def test_generate_batch_matches_generate_and_uses_transformers_names():
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
    out = generate_batch(model(), PROMPTS, generation_config=gen, **ENGINE)
    assert sorted(out) == ["req_0", "req_1", "req_2"]
    for i, p in enumerate(PROMPTS):
        r = out[f"req_{i}"]
        assert r.generated_tokens == greedy(p, 8) and r.prompt_ids == p
        assert r.status == RequestStatus.FINISHED and r.is_finished()
    assert generate_batch(model(), []) == {}
    # The model method the lead attaches forwards here.
    again = model().generate_batch(PROMPTS[:1], generation_config=gen, max_new_tokens=3, **ENGINE)
    assert again["req_0"].generated_tokens == greedy(PROMPTS[0], 3)


def test_manager_streams_cancels_and_stops():
    gen = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None)
    manager = init_continuous_batching(model(), generation_config=gen, **ENGINE)
    manager.start()
    try:
        streamed = manager.add_request(PROMPTS[0], max_new_tokens=6, streaming=True)
        plain = manager.add_request(PROMPTS[1], request_id="mine")
        doomed = manager.add_request(PROMPTS[2], max_new_tokens=10_000 // 200)
        manager.cancel_request(doomed)
        chunks = list(manager.request_id_iter(streamed))
        assert [c.generated_tokens for c in chunks] == [greedy(PROMPTS[0], 6)[:k] for k in range(1, 7)]
        assert chunks[-1].is_finished() and not chunks[0].is_finished()
        final = manager.get_result("mine", timeout=30)
        assert final.generated_tokens == greedy(PROMPTS[1], 20) and plain == "mine"
        cancelled = manager.get_result(doomed, timeout=30)
        assert cancelled.finish_reason == "abort"
        with pytest.raises(RequestTooLongError):
            manager.add_request([5] * 256)
    finally:
        manager.stop(block=True, timeout=30)
    assert not manager.is_running()
    assert manager.engine.block_manager.num_free_blocks == 64
    assert manager.get_result(timeout=0.1) is None


def test_engine_attention_default_is_triton_on_cuda_and_sdpa_elsewhere():
    import torch

    from cudaformers.engine.llm import engine_attention

    assert engine_attention(torch.device("cpu")) == "sdpa"
    assert engine_attention(torch.device("cuda", 0)) == "triton"  # decided from the device alone


def test_warm_up_steps_leave_the_cache_to_requests():
    """The engine's start-up warm-up (run on CUDA: prefill + decode steps at every chunk size class)
    writes only blocks no request holds: tokens after it equal generate()'s."""
    from cudaformers.engine.continuous_batching import destroy_cached_engine

    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    kw = dict(num_blocks=128, block_size=4, max_batch_tokens=320, persistent_manager=True)
    m = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"))
    try:
        generate_batch(m, PROMPTS[:1], generation_config=gen, **kw)
        runner = m._cudaformers_engine[1].runner
        steps = []
        real = runner._eager
        runner._eager = lambda batch, *a: steps.append(batch.num_tokens) or real(batch, *a)
        runner.warm_up_mixed_step()
        assert len(steps) >= 5 and steps[-1] < steps[0] / 2  # the chunk sizes halve
        out = generate_batch(m, PROMPTS, generation_config=gen, **kw)
        assert [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))] == [greedy(p, 6) for p in PROMPTS]
    finally:
        destroy_cached_engine(m)
