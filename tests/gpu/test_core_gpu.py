"""The core on a GPU: loading, logits against transformers in bf16/fp16, graph decode == eager."""

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral_window"])
def test_logits_close_to_transformers(name, dtype):
    folder = tiny.checkpoint(name)
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cuda")
    ref = tiny.hf_model(folder, dtype=dtype).cuda()
    ref32 = tiny.hf_model(folder).cuda()
    ids = torch.randint(3, 211, (2, 48), device="cuda")
    with torch.no_grad():
        got, want, exact = ours(ids).logits.float(), ref(ids).logits.float(), ref32(ids).logits
    # Within 2x the error transformers itself makes in this dtype, against fp32.
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attn", ["sdpa", "triton"])
def test_graph_decode_equals_eager(dtype, attn):
    folder = tiny.checkpoint("qwen3")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cuda", attn_implementation=attn)
    ids = torch.randint(3, 211, (3, 17), device="cuda")
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    graph = model.generate(ids, use_cuda_graph=True, **kw)
    eager = model.generate(ids, use_cuda_graph=False, **kw)
    assert torch.equal(graph, eager)
    assert "generate cuda graphs" not in model.explain() or "on" in model.explain()


@pytest.mark.parametrize("attn", ["sdpa", "triton"])
def test_graph_loop_reused_across_calls_equals_eager(attn):
    """The captured loop (model step + sampling + stop rules) is reused by later calls whose eos
    ids, pad id, min_new_tokens and lengths differ: each call must still equal the eager loop."""
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), device_map="cuda", attn_implementation=attn)
    ids = torch.randint(3, 211, (2, 9), device="cuda")
    probe = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, use_cuda_graph=False)
    stop = int(probe[0, 9 + 5])  # a token row 0 emits early: an eos that ends it mid-run
    calls = [dict(max_new_tokens=30, eos_token_id=None),
             dict(max_new_tokens=30, eos_token_id=stop, pad_token_id=7),
             dict(max_new_tokens=30, eos_token_id=[stop, 5], pad_token_id=1, min_new_tokens=8),
             dict(max_new_tokens=12, eos_token_id=stop, pad_token_id=2, repetition_penalty=1.3)]
    longer = torch.randint(3, 211, (2, 21), device="cuda")  # same padded prompt width (64): graphs reused
    for prompt in (ids, longer):
        for kw in calls:
            graph = model.generate(prompt, do_sample=False, use_cuda_graph=True, **kw)
            eager = model.generate(prompt, do_sample=False, use_cuda_graph=False, **kw)
            assert torch.equal(graph, eager), kw
    unseeded = model.generate(ids, do_sample=True, top_k=5, max_new_tokens=16, eos_token_id=None)
    assert unseeded.shape == (2, 25) and bool((unseeded[:, 9:] < model.config.vocab_size).all())


def test_graphs_follow_a_replaced_module():
    """A module swapped in after a captured call is what the next (captured again) call runs."""
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), device_map="cuda", attn_implementation="triton")
    ids = torch.randint(3, 211, (2, 9), device="cuda")
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    model.generate(ids, **kw)
    old = model.model.layers[-1].mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False, device="cuda", dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight * -4.0)
    model.model.layers[-1].mlp.down_proj = new
    graph = model.generate(ids, **kw)
    assert model._choices["generate cuda graphs"] == "on"
    assert torch.equal(graph, model.generate(ids, use_cuda_graph=False, **kw))
    model.set_attn_implementation("sdpa")
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cuda_graph=False, **kw))


def test_fp32_greedy_equals_transformers_on_gpu():
    folder = tiny.checkpoint("llama")
    ours = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda")
    ref = tiny.hf_model(folder).cuda()
    ids = torch.randint(3, 211, (1, 10), device="cuda")
    kw = dict(max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def test_sampling_on_gpu_is_seeded():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), dtype=torch.bfloat16, device_map="cuda")
    ids = torch.randint(3, 211, (2, 8), device="cuda")
    kw = dict(do_sample=True, top_p=0.9, temperature=0.8, max_new_tokens=24, seed=3, eos_token_id=None)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, **kw))


def test_device_map_auto_places_on_gpu():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen2"), device_map="auto")
    assert all(t.device.type == "cuda" for t in [*model.parameters(), *model.buffers()])
    # "auto" places unit by unit; its greedy tokens (CUDA graphs on one GPU) are those of device_map="cuda"
    one = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen2"), device_map="cuda")
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(3)).cuda()
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, **kw), one.generate(ids, **kw))
