"""The decode step's one-launch inputs (kernels/step_inputs.py) against the torch path they replace
(``generation.decode.step_inputs_torch``), bit for bit, and generate() through them against
generate() with the model computing its own rotary. Interpreted on the CPU; the GPU and CUDA-graph
runs are tests/gpu/test_step_inputs_gpu.py and test_core_gpu.py's graph-equals-eager checks."""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tiny  # noqa: E402
from cudaformers import AutoModelForCausalLM  # noqa: E402
from cudaformers.generation import decode  # noqa: E402
from cudaformers.generation.decode import step_inputs_torch  # noqa: E402
from cudaformers.kernels.step_inputs import ROPE_ROWS, step_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, page: int, capacity: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = -(-capacity // page)
    table = torch.randperm(rows * width, generator=g).int().view(rows, width).to(DEVICE)
    positions = torch.randint(0, capacity, (rows,), generator=g).to(DEVICE)
    return positions, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,page,dim", [(1, 16, 64), (3, 16, 24), (ROPE_ROWS, 256, 128), (ROPE_ROWS + 1, 16, 64),
                                           (40, 32, 100)])
def test_same_bits_as_the_torch_path(rows, page, dim, dtype):
    capacity = 300
    positions, table = _case(rows, page, capacity, seed=rows * 7 + dim)
    g = torch.Generator().manual_seed(dim)
    rope = tuple(torch.randn(capacity, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    got, want = step_inputs(positions, table, page, rope), step_inputs_torch(positions, table, page, rope)
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(got[3], want[3]))
    # Without a table: the metadata alone.
    bare = step_inputs(positions, table, page)
    assert bare[3] is None and all(torch.equal(a, b) for a, b in zip(bare[:3], want[:3]))


def test_bad_shapes_are_named():
    positions, table = _case(4, 16, 64, seed=0)
    with pytest.raises(ValueError, match="block_table"):
        step_inputs(positions, table[:3], 16)
    rope = torch.zeros(64, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rope_table"):
        step_inputs(positions, table, 16, (rope, rope[:, :4]))


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_generate_through_the_table_equals_the_models_own_rotary(name, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name)).to(DEVICE).eval()
    ids = torch.randint(3, 211, (3, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, use_cuda_graph=False)
    calls = []
    real = decode._rope_table
    monkeypatch.setattr(decode, "_rope_table", lambda *a: calls.append(1) or real(*a))
    with_table = model.generate(ids, **kw)
    assert calls and model._decode_runners and next(iter(model._decode_runners.values())).rope_table is not None
    model.__dict__.pop("_decode_runners")
    monkeypatch.setattr(decode, "_rope_table", lambda *a: None)
    assert torch.equal(with_table, model.generate(ids, **kw))
