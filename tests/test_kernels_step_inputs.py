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


@pytest.mark.parametrize("embed_rows", [16, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,page,dim", [(1, 16, 64), (3, 16, 24), (ROPE_ROWS, 256, 128), (ROPE_ROWS + 1, 16, 64),
                                           (40, 32, 100)])
def test_same_bits_as_the_torch_path(rows, page, dim, dtype, embed_rows, monkeypatch):
    monkeypatch.setattr("cudaformers.kernels.step_inputs.EMBED_ROWS", embed_rows)
    capacity = 300
    positions, table = _case(rows, page, capacity, seed=rows * 7 + dim)
    g = torch.Generator().manual_seed(dim)
    rope = tuple(torch.randn(capacity, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    # An odd hidden size past one 1024-column chunk, and a strided (row-padded) table.
    embedding = torch.randn(50, dim * 11 + 1040, generator=g).to(DEVICE, dtype)[:, :dim * 11 + 1030]
    tokens = torch.randint(0, 50, (rows,), generator=g).to(DEVICE)
    inputs = (positions, table, page, rope, tokens, embedding)
    got, want = step_inputs(*inputs), step_inputs_torch(*inputs)
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(got[3], want[3]))
    assert got[4].dtype == dtype and torch.equal(got[4], want[4])
    # Without a table or an embedding: the metadata alone; each alone.
    bare = step_inputs(positions, table, page)
    assert bare[3] is None and bare[4] is None and all(torch.equal(a, b) for a, b in zip(bare[:3], want[:3]))
    assert step_inputs(positions, table, page, rope)[4] is None
    only = step_inputs(positions, table, page, None, tokens, embedding)
    assert only[3] is None and torch.equal(only[4], want[4])


def test_bad_shapes_are_named():
    positions, table = _case(4, 16, 64, seed=0)
    with pytest.raises(ValueError, match="block_table"):
        step_inputs(positions, table[:3], 16)
    rope = torch.zeros(64, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rope_table"):
        step_inputs(positions, table, 16, (rope, rope[:, :4]))
    embedding = torch.zeros(10, 8, device=DEVICE)
    with pytest.raises(ValueError, match="tokens and embedding"):
        step_inputs(positions, table, 16, None, None, embedding)
    with pytest.raises(ValueError, match="must match positions"):
        step_inputs(positions, table, 16, None, positions[:2], embedding)


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


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_generate_through_gathered_embeddings_equals_the_models_own(name, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name)).to(DEVICE).eval()
    ids = torch.randint(3, 211, (3, 5), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, use_cuda_graph=False)
    gathered = []
    real = decode._embedding_table
    monkeypatch.setattr(decode, "_embedding_table", lambda *a: gathered.append(real(*a)) or gathered[-1])
    with_gather = model.generate(ids, **kw)
    assert gathered and all(w is model.model.embed_tokens.weight for w in gathered)
    model.__dict__.pop("_decode_runners")
    monkeypatch.setattr(decode, "_embedding_table", lambda *a: None)
    assert torch.equal(with_gather, model.generate(ids, **kw))


def test_a_hooked_embedding_still_runs_its_hook():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).to(DEVICE).eval()
    ids = torch.randint(3, 211, (1, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, use_cuda_graph=False)
    assert seen == [5, 1, 1, 1]  # the prompt, then every decode step through the module itself


_COMPILE_FOR_SM90 = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_kernels_pdl import _ptx
from cudaformers.kernels.step_inputs import _step_inputs_kernel
i64, i32, b16 = (torch.zeros(2, dtype=t) for t in (torch.int64, torch.int32, torch.bfloat16))
for rope, embed, rows in ((True, True, 16), (True, False, 16), (False, True, 16), (False, False, 16), (True, True, 1)):
    _ptx(_step_inputs_kernel, (i64, i32, i32, i64, i32, b16, b16, b16, b16, i64, b16, b16, 1, 4, 128, 1024, 1024),
         dict(PAGE=256, BLOCK_B=1, HAS_ROPE=rope, ROWS=16, BLOCK_D=128, HAS_EMBED=embed, E_ROWS=rows, BLOCK_H=1024,
              num_warps=4))
print("compiled")
"""


def test_the_kernel_compiles_for_hopper():
    # The interpreter accepts what the compiler rejects (a loop retyping a variable of another
    # branch did): every variant is built for sm_90 here, no GPU needed.
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, tests], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(tests))
    assert done.returncode == 0 and done.stdout.strip().endswith("compiled"), done.stderr[-3000:]
