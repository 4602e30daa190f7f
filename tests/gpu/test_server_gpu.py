"""The server on a GPU: CUDA-graph decode and async batching behind concurrent, staggered streams
give generate()'s tokens; a client leaving mid-stream frees its blocks."""

import asyncio
import json

import httpx
import pytest
import torch

import tiny
from server_fixtures import LiveServer

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 13, 21, 8], list(range(100, 140)), [177], list(range(3, 16)), [42, 43],
           list(range(20, 110)), [7] * 33, [11, 12, 13]]


async def _stream(url, prompt, delay, n, leave_after=None):
    await asyncio.sleep(delay)
    ids = []
    async with httpx.AsyncClient(timeout=120) as c:
        body = dict(model=LiveServer.NAME, prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True,
                    stream=True, return_token_ids=True)
        async with c.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
                    if leave_after is not None and len(ids) >= leave_after:
                        return ids
    return ids


@pytest.mark.parametrize("attn", ["triton", "sdpa"])
def test_staggered_streams_equal_generate_with_graphs_and_async(attn):
    from cudaformers import AutoModelForCausalLM

    # No tokenizer (the GPU machine has no gguf to read SmolLM2's): token ids in, token ids out.
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), device_map="cuda",
                                                 attn_implementation=attn)
    with LiveServer(model=model, num_blocks=400, block_size=16, max_batch_tokens=128, max_num_seqs=16) as s:
        engine = s.state.engine.engine
        assert engine.use_async_batching and engine.runner.graphs is not None

        async def run():
            jobs = [_stream(s.url, p, 0.01 * i, 40) for i, p in enumerate(PROMPTS)]
            jobs.append(_stream(s.url, list(range(50, 70)), 0.0, 200, leave_after=5))
            return await asyncio.gather(*jobs)

        *got, left = asyncio.run(run())
        for p, ids in zip(PROMPTS, got):
            ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False,
                                 eos_token_id=None)
            assert ids == ref[0, len(p):].tolist()
        assert 5 <= len(left) < 200
        s.wait_idle()
        assert s.state.metrics.finished.get("abort") == 1
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
