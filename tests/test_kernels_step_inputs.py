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
    assert got.hidden is None and want.hidden is None
    # Without a table: the metadata alone.
    bare = step_inputs(positions, table, page)
    assert bare[3] is None and all(torch.equal(a, b) for a, b in zip(bare[:3], want[:3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden,rope", [(1, 64, True), (3, 100, False), (ROPE_ROWS + 1, 1024, True),
                                              (2, 1500, True)])
def test_embedding_rows_are_gathered_bit_for_bit(rows, hidden, rope, dtype):
    capacity, page, vocab = 64, 16, 97
    positions, table = _case(rows, page, capacity, seed=hidden)
    g = torch.Generator().manual_seed(hidden)
    embedding = torch.randn(vocab, hidden, generator=g).to(DEVICE, dtype)
    tokens = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    tokens[0] = vocab - 1  # the table's last row
    table_rows = tuple(torch.randn(capacity, 32, generator=g).to(DEVICE, dtype) for _ in range(2)) if rope else None
    got = step_inputs(positions, table, page, table_rows, tokens, embedding)
    want = step_inputs_torch(positions, table, page, table_rows, tokens, embedding)
    assert got.hidden.dtype == dtype and torch.equal(got.hidden, want.hidden)
    assert torch.equal(got.hidden, torch.nn.functional.embedding(tokens, embedding))
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))


def test_bad_shapes_are_named():
    positions, table = _case(4, 16, 64, seed=0)
    with pytest.raises(ValueError, match="block_table"):
        step_inputs(positions, table[:3], 16)
    rope = torch.zeros(64, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rope_table"):
        step_inputs(positions, table, 16, (rope, rope[:, :4]))
    with pytest.raises(ValueError, match="pass both or neither"):
        step_inputs(positions, table, 16, tokens=positions)
    with pytest.raises(ValueError, match=r"tokens \(3,\) must be \[B\]"):
        step_inputs(positions, table, 16, tokens=positions[:3], embedding=rope)


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


def test_generate_through_the_gathered_embeddings_equals_the_models_own(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).to(DEVICE).eval()
    ids = torch.randint(3, 211, (2, 6), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    kw = dict(max_new_tokens=7, do_sample=False, eos_token_id=None, use_cuda_graph=False)
    seen = []
    real = decode._plain_embedding
    monkeypatch.setattr(decode, "_plain_embedding", lambda *a: seen.append(real(*a)) or seen[-1])
    gathered = model.generate(ids, **kw)
    assert seen and all(w is not None and w.data_ptr() == model.model.embed_tokens.weight.data_ptr() for w in seen)
    model.__dict__.pop("_decode_runners")
    monkeypatch.setattr(decode, "_plain_embedding", lambda *a: None)
    assert torch.equal(gathered, model.generate(ids, **kw))


def test_a_hooked_embedding_is_left_to_the_model():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).to(DEVICE).eval()
    assert decode._plain_embedding(model, model.device) is not None
    handle = model.model.embed_tokens.register_forward_hook(lambda m, i, o: o * 2)
    assert decode._plain_embedding(model, model.device) is None
    handle.remove()
    model.model.embed_tokens.max_norm = 1.0
    assert decode._plain_embedding(model, model.device) is None
