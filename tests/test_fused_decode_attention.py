"""The fused decode attention (q/k norm + rope + KV-cache store + paged decode in one launch, run by the
"DecoderLayer" kernel) on tiny models with the triton backend: the same greedy tokens as the unfused
kernels and as plain PyTorch, from generate() and from the engine, and only where it is exact."""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tiny  # noqa: E402
from cudaformers import AutoModelForCausalLM  # noqa: E402
from cudaformers.engine.llm_engine import LLMEngine  # noqa: E402
from cudaformers.engine.sampling_params import SamplingParams  # noqa: E402
from cudaformers.kernels import paged_decode as paged_module  # noqa: E402
from cudaformers.kernels.hub import KernelConfig  # noqa: E402

ROPE = {"cpu": {"inference": "cudaformers:qk_norm_rope", "training": ""}}
LAYER = {"cpu": {"inference": "cudaformers:fused_norm_decode", "training": ""}}
FUSED = KernelConfig({"rotary_pos_emb": ROPE, "DecoderLayer": LAYER, "Linear": "cudaformers:gemv"})
UNFUSED = KernelConfig({"rotary_pos_emb": ROPE, "DecoderLayer": "", "Linear": "cudaformers:gemv"})
GREEDY = dict(max_new_tokens=5, do_sample=False, eos_token_id=None)


@pytest.fixture
def launches(monkeypatch):
    """Sequences seen by each fused launch."""
    calls = []
    real = paged_module.paged_decode_rope

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(paged_module, "paged_decode_rope", counting)
    return calls


def _model(name, config, attn="triton", dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), kernel_config=config, dtype=dtype,
                                                attn_implementation=attn).eval()


# qwen3: per-head q/k norm; llama_bias: none, packed biases; mistral_window: a sliding window of 8.
@pytest.mark.parametrize("name", ["qwen3", "llama_bias", "mistral_window"])
def test_generate_equals_the_unfused_kernels_and_plain_pytorch(name, launches):
    ids = torch.randint(3, 211, (2, 6), generator=torch.Generator().manual_seed(2))
    want = _model(name, UNFUSED).generate(ids, **GREEDY)
    assert not launches
    fused = _model(name, FUSED)
    got = fused.generate(ids, **GREEDY)
    assert torch.equal(got, want)
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), use_kernels=False).eval()
    assert torch.equal(got, plain.generate(ids, **GREEDY))
    # The prefill runs unfused; each later step is one launch per layer for both rows.
    assert launches == [2] * ((GREEDY["max_new_tokens"] - 1) * len(fused.model.layers))


def test_bf16_tokens_equal_the_unfused_kernels(launches):
    ids = torch.randint(3, 211, (1, 5), generator=torch.Generator().manual_seed(3))
    want = _model("qwen3_tied", UNFUSED, dtype=torch.bfloat16).generate(ids, **GREEDY)
    assert torch.equal(_model("qwen3_tied", FUSED, dtype=torch.bfloat16).generate(ids, **GREEDY), want)
    assert launches


def test_engine_decode_steps_fuse_and_mixed_steps_do_not(launches):
    prompts = [torch.randint(3, 211, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11, 6)]

    def run(config):
        engine = LLMEngine(_model("qwen3", config), num_blocks=64, block_size=4, max_batch_tokens=9, max_num_seqs=4)
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        return [engine.requests[i].output_token_ids for i in ids]

    want = run(UNFUSED)
    assert not launches
    assert run(FUSED) == want
    assert launches  # the all-decode steps


def test_not_where_the_unfused_path_differs(launches):
    ids = torch.randint(3, 211, (1, 4), generator=torch.Generator().manual_seed(4))
    # sdpa attention; plain PyTorch rotary (it rounds q and k at other steps than the kernel)
    plain_rope = KernelConfig({"rotary_pos_emb": "", "DecoderLayer": LAYER, "Linear": "cudaformers:gemv"})
    for model in (_model("qwen3", FUSED, attn="sdpa"), _model("qwen3", plain_rope)):
        model.generate(ids, **GREEDY)
    assert not launches
    # a hook on the attention module would be bypassed
    model = _model("qwen3", FUSED)
    seen = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: seen.append(1))
    model.generate(ids, **GREEDY)
    assert len(seen) == GREEDY["max_new_tokens"] and len(launches) == GREEDY["max_new_tokens"] - 1  # layer 1 only
