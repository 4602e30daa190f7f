"""The engine on a GPU: CUDA-graph decode and async batching give the same tokens as the eager,
synchronous loop and as generate(); memory-sized cache; no leaked blocks."""

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM
from cudaformers.engine.llm_engine import LLMEngine
from cudaformers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 211, (n,), generator=g).tolist() for n in lengths]


def _run(engine, ps, n, **sp):
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **sp)) for p in ps]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [engine.requests[i].output_token_ids for i in ids]


@pytest.mark.parametrize("attn", ["triton", "sdpa"])
def test_graphs_and_async_equal_eager_sync_fp32(attn):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), device_map="cuda", attn_implementation=attn)
    ps = _prompts([5, 40, 1, 17, 23, 9, 3, 30, 11])
    kw = dict(num_blocks=96, block_size=4, max_batch_tokens=24, max_num_seqs=16)
    base = LLMEngine(model, use_cuda_graph=False, use_async_batching=False, **kw)
    want = _run(base, ps, 30)
    for graphs, use_async in [(True, False), (False, True), (True, True)]:
        engine = LLMEngine(model, use_cuda_graph=graphs, use_async_batching=use_async, **kw)
        assert _run(engine, ps, 30) == want, (graphs, use_async)
    for p, w in zip(ps, want):
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=30, do_sample=False, eos_token_id=None)
        assert ref[0, len(p):].tolist() == w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_preemption_and_prefix_cache_with_graphs(dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=dtype, device_map="cuda",
                                                 attn_implementation="triton")
    shared = _prompts([12], seed=1)[0]
    ps = [shared + p for p in _prompts([3, 9, 1, 14, 6], seed=2)]
    roomy = LLMEngine(model, num_blocks=200, block_size=4, use_async_batching=False, enable_prefix_caching=False)
    want = _run(roomy, ps, 40)
    tight = LLMEngine(model, num_blocks=30, block_size=4)  # graphs + async, preemption forced
    got = _run(tight, ps, 40)
    assert tight.stats()["preemptions"] > 0
    # Low precision: a recomputed prefill may round differently from decode; most rows still match.
    assert sum(g == w for g, w in zip(got, want)) >= len(ps) - 1


def test_cache_sized_from_free_memory_and_sampling_runs():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), dtype=torch.bfloat16, device_map="cuda")
    engine = LLMEngine(model, max_memory_percent=0.05, max_batch_tokens=512, max_num_seqs=8)
    free, _ = torch.cuda.mem_get_info()
    assert engine.runner.num_blocks > 0 and engine.runner.graphs is not None and engine.use_async_batching
    ids = [engine.add_request(p, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, max_tokens=20,
                                                logprobs=2))
           for i, p in enumerate(_prompts([7, 30, 2]))]
    while engine.has_unfinished_requests():
        engine.step()
    for i in ids:
        seq = engine.requests[i]
        assert 1 <= seq.num_output_tokens <= 20 and len(seq.logprobs) == seq.num_output_tokens
    assert free > 0


def test_dropped_models_and_engines_free_their_gpu_memory_at_once():
    """With graphs captured (generate's and the engine's), dropping the engine and the model returns
    every byte they held without the garbage collector: nothing of theirs can be collected later in
    the middle of another capture."""
    import gc

    # Built out here: building it keeps a cycle through transformers' frames, whose f_back chain would
    # hold use_and_drop's frame, and so its model, until the collector ran.
    checkpoint = tiny.checkpoint("qwen3")

    def use_and_drop():
        model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="cuda",
                                                     attn_implementation="triton")
        model.generate(torch.randint(3, 211, (2, 9), device="cuda"), max_new_tokens=8, do_sample=False,
                       eos_token_id=None)
        engine = LLMEngine(model, num_blocks=64, block_size=16)
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs
        _run(engine, _prompts([5, 17]), 6)

    use_and_drop()  # process-wide buffers (split counters, the warm-up stream's workspace) are made once, here
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    enabled = gc.isenabled()
    gc.disable()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        use_and_drop()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        assert kept == 0, f"{kept} bytes kept; allocated then and still alive:\n{_alive_since(before)}"
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        if enabled:
            gc.enable()


def _alive_since(before: int, largest: int = 5) -> str:
    """The largest live blocks the recorded history saw allocated, with the innermost Python frames of
    their allocation: what a failing memory check names."""
    snapshot = torch.cuda.memory._snapshot()
    blocks = [b for seg in snapshot["segments"] for b in seg["blocks"]
              if b["state"] == "active_allocated" and b.get("frames")]
    blocks.sort(key=lambda b: -b["size"])
    lines = []
    for b in blocks[:largest]:
        frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in b["frames"]
                  if f["filename"].endswith(".py")][:6]
        lines.append(f"{b['size']} bytes: " + " <- ".join(frames))
    return "\n".join(lines) or f"(no recorded block; {torch.cuda.memory_allocated() - before} bytes)"
