"""The act-order feature gather on the GPU: in a CUDA graph between PDL kernels (it reads what the
kernel before it wrote, and the int4 GEMV after it reads its output), replayed with new inputs."""

import pytest
import torch

from cudaformers.kernels.activation import act_and_mul
from cudaformers.kernels.feature_gather import gather_features, gather_features_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", [(1, 4096), (1, 12288), (3, 1000), (16, 4097)])
def test_gather_matches_index_select_on_gpu(shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_()
    order = torch.randperm(shape[-1], device="cuda", generator=gen)
    out = gather_features(x, order)
    torch.testing.assert_close(out, gather_features_reference(x.detach(), order), rtol=0, atol=0)
    dy = torch.randn_like(out)
    out.backward(dy)
    want = torch.empty_like(dy)
    want[..., order] = dy
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def test_gather_in_a_graph_chain_reads_its_producer():
    from cudaformers.quant.int4 import Int4Linear

    k, n = 4096, 6144
    gen = torch.Generator(device="cuda").manual_seed(1)
    layer = Int4Linear(k, n, False, torch.bfloat16, act_order=True).cuda()
    with torch.no_grad():  # the order first: quantize_ reads the columns through it
        layer.input_order.copy_(torch.randperm(k, device="cuda", generator=gen))
        layer.quantize_(torch.randn(n, k, device="cuda", generator=gen))
    gate, up = (torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        def step():
            return layer(act_and_mul(gate, up, "silu"))  # PDL kernel -> gather -> fragment GEMV

        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for seed in range(3):
            gate.copy_(torch.randn(1, k, device="cuda", generator=gen))
            graph.replay()
            want = layer.matmul(act_and_mul(gate, up, "silu"))  # eager
            torch.testing.assert_close(out, want, rtol=0, atol=0)
            h = torch.nn.functional.silu(gate.float()) * up.float()
            ref = h @ layer.dequantize(torch.float32).T
            assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2, seed
