"""The greedy ``advance`` kernel (kernels/greedy_advance.py) at Qwen3's vocabulary on the GPU: bit-exact
against torch's ops (CUDA argmax) over consecutive steps, eagerly and replayed from a CUDA graph that
holds the kernel the way generate()'s decode graph does (with PDL on Hopper), and through advance()."""

import pytest
import torch

from cudaformers.generation.logits import SamplingTensors
from cudaformers.generation.loop import LoopKind, LoopState, advance
from cudaformers.kernels import greedy_advance as ga
from cudaformers.kernels.greedy_advance import greedy_advance, greedy_advance_reference

pytestmark = pytest.mark.gpu
V, DEV, PAD = 151936, "cuda", 151643
EOS = [151645, 151643]
GREEDY = LoopKind(sampling=False, top_k=False, top_p=False, min_p=False, penalty=False, min_new=False)
FIELDS = ("tokens", "out", "finished", "ends", "step")


def _state(rows, max_new=12, capacity=16):
    state = LoopState(GREEDY, rows, capacity, V, DEV)
    st = SamplingTensors.build([{}] * rows, DEV)
    state.start(st, None, torch.tensor(EOS, device=DEV), PAD, 0, max_new, torch.zeros(rows, dtype=torch.long,
                                                                                          device=DEV))
    if rows > 2:
        state.finished[2] = True
    return state


def _logits(rows, step, dtype, strided=False):
    """Random logits with the awkward cases: ties, NaN, +inf, all -inf, eos wins for some rows."""
    g = torch.Generator(device=DEV).manual_seed(step)
    wide = torch.randn(rows, V + 64, device=DEV, generator=g).to(dtype)
    x = wide[:, 8:8 + V] if strided else wide[:, :V].contiguous()
    r = step % rows
    kind = step % 5
    if kind == 1:
        x[r, [90000, 4096, 150000]] = 40  # ties, one across a split
    elif kind == 2:
        x[r, [7, 99999]] = float("nan")
    elif kind == 3:
        x[r] = float("-inf")
    elif kind == 4:
        x[r, 123456] = float("inf")
    if step in (3, 7) and rows > 1:
        x[(r + 1) % rows, EOS[0 if step == 3 else 1]] = 50
    return x


def _same(a, b, what):
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), (what, name, getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("one_launch", [True, False])
def test_eager_steps_match_torch(rows, dtype, strided, one_launch, monkeypatch):
    monkeypatch.setattr(ga, "ONE_LAUNCH", one_launch)
    ours, ref = _state(rows), _state(rows)
    for step in range(14):  # past max_new: ends and the pad rows keep the torch path's values
        x = _logits(rows, step, dtype, strided)
        greedy_advance(x, ours)
        greedy_advance_reference(x, ref)
        _same(ours, ref, step)
    if rows > 1:
        assert ref.finished.sum() >= 3  # eos hits happened (and the preset row)


@pytest.mark.parametrize("rows", [1, 32])
def test_graph_replays_match_torch(rows):
    ours, ref = _state(rows), _state(rows)
    logits = torch.zeros(rows, V, device=DEV, dtype=torch.bfloat16)
    scratch = _state(rows)  # warm-up and capture write into copies, not into ours
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        advance(logits, scratch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits.mul_(1)  # a torch kernel before it, as positions += 1 is in the decode graph
        advance(logits, ours)
    for step in range(12):
        logits.copy_(_logits(rows, step, torch.bfloat16))
        graph.replay()
        greedy_advance_reference(logits, ref)
        torch.cuda.synchronize()
        _same(ours, ref, step)


def test_advance_uses_the_kernel_on_the_gpu(monkeypatch):
    from cudaformers.kernels import greedy_advance as ga

    calls = []
    real = ga.greedy_advance
    monkeypatch.setattr(ga, "greedy_advance", lambda logits, state: (calls.append(1), real(logits, state)))
    ours, ref = _state(4), _state(4)
    x = _logits(4, 1, torch.bfloat16)
    advance(x, ours)
    greedy_advance_reference(x, ref)
    assert calls == [1]
    _same(ours, ref, 0)
