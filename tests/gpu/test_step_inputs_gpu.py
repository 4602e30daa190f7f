"""The decode step's one-launch inputs (kernels/step_inputs.py) on the GPU: the same bits as the torch
path at batch 1, 32 and 256, eagerly and replayed from a CUDA graph after the positions move on."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 32, 256])
def test_same_bits_eager_and_in_a_graph(rows):
    from cudaformers.generation.decode import step_inputs_torch
    from cudaformers.kernels.step_inputs import step_inputs

    g = torch.Generator(device="cuda").manual_seed(rows)
    capacity, page = 4096, 256
    table = torch.randperm(rows * capacity // page, device="cuda", generator=g).int().view(rows, -1)
    positions = torch.randint(0, capacity - 8, (rows,), device="cuda", generator=g)
    rope = tuple(torch.randn(capacity, 128, device="cuda", generator=g).bfloat16() for _ in range(2))

    def check(got):
        want = step_inputs_torch(positions, table, page, rope)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
        assert all(torch.equal(a, b) for a, b in zip(got[3], want[3]))

    check(step_inputs(positions, table, page, rope))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step_inputs(positions, table, page, rope)
    for _ in range(3):
        positions += 1
        graph.replay()
        check(out)
