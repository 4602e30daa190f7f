"""The gated down-projection GEMV at qwen3-0.6b size on the GPU: accuracy against the fp64 reference,
CUDA-graph capture, and the model-level swap under generate()."""

import pytest
import torch
import torch.nn.functional as F

from cudaformers.kernels.gemv import gemv_act_mul
from cudaformers.layers.activation import act_and_mul_reference

pytestmark = pytest.mark.gpu
HIDDEN, INTERMEDIATE = 1024, 3072


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, 4])
def test_full_size_against_reference(rows, activation, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows)
    packed = torch.randn(rows, 2 * INTERMEDIATE, device="cuda", generator=g) * 2
    gate, up = packed.to(dtype).split(INTERMEDIATE, dim=-1)
    w = (torch.randn(HIDDEN, INTERMEDIATE, device="cuda", generator=g) / INTERMEDIATE ** 0.5).to(dtype)
    got = gemv_act_mul(gate, up, w, activation=activation)
    exact = F.linear(act_and_mul_reference(gate.double(), up.double(), activation), w.double())
    unfused = F.linear(act_and_mul_reference(gate, up, activation), w)  # the plain path, in dtype
    err = (got.double() - exact).abs().max().item()
    budget = 1e-4 * exact.abs().max().item() if dtype == torch.float32 else \
        2 * (unfused.double() - exact).abs().max().item()
    assert err <= budget, (err, budget)


def test_graph_capturable():
    gate, up = torch.randn(1, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16).split(INTERMEDIATE, dim=-1)
    w = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16) / INTERMEDIATE ** 0.5
    want = gemv_act_mul(gate, up, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_act_mul(gate, up, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_generate_with_and_without_the_fused_mlp():
    import tiny
    from cudaformers import AutoModelForCausalLM, KernelConfig

    folder = tiny.checkpoint("qwen3")
    ids = torch.randint(3, 211, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    fused = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", use_kernels=True)
    assert "GatedMLP -> cudaformers:fused_mlp_decode" in fused.explain()
    plain = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", use_kernels=True,
                                                 kernel_config=KernelConfig({"GatedMLP": ""}))
    assert torch.equal(fused.generate(ids, **kw), plain.generate(ids, **kw))
