"""The greedy ``advance`` kernel (kernels/greedy_advance.py) against the torch path it replaces, bit for
bit, over several consecutive steps: ties, NaN, -inf and +inf rows, rows finished before the call,
eos hits, strided logits, tilings with several splits and several tiles per program. Interpreted on
the CPU; the full-size and CUDA-graph checks are in tests/gpu/test_greedy_advance_gpu.py."""

import json
import os
import sys

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.generation import loop  # noqa: E402
from cudaformers.generation.logits import SamplingTensors  # noqa: E402
from cudaformers.generation.loop import LoopKind, LoopState, advance  # noqa: E402
from cudaformers.kernels import greedy_advance as ga  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GREEDY = LoopKind(sampling=False, top_k=False, top_p=False, min_p=False, penalty=False, min_new=False)
FIELDS = ("tokens", "positions", "out", "finished", "ends", "step")


def _state(kind, rows, vocab, eos, pad=3, max_new=5, capacity=6, finished=(), min_new=0):
    state = LoopState(kind, rows, capacity, vocab, "cpu")
    st = SamplingTensors.build([{"temperature": 0.7, "top_k": 5}] * rows, "cpu")  # values greedy ignores
    seen = torch.zeros(rows, vocab, dtype=torch.bool) if kind.penalty else None
    state.start(st, seen, torch.tensor(eos), pad, min_new, max_new, torch.zeros(rows, dtype=torch.long))
    state.finished[list(finished)] = True
    return state


def _logits(rows, vocab, dtype, step, seed, eos, block):
    """Random rows with the awkward cases planted at fixed rows: ties (also one tile apart, in one
    lane), NaNs, +inf, all -inf, all NaN, all equal; eos wins row 1 at step 1 and row 2 at step 2."""
    g = torch.Generator().manual_seed(seed * 100 + step)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    for r in range(rows):
        kind = (r + step) % 8 if r != step or step not in (1, 2) else 0
        a, b = (vocab // 3 + r) % vocab, (vocab // 2 + 7 * r) % vocab
        if kind == 1:  # equal maxima: the first one wins
            x[r, [b, a, vocab - 1]] = 50
        elif kind == 2 and vocab > r + block:  # equal maxima in one lane of consecutive tiles
            x[r, [r + block, r]] = 50
        elif kind == 3:  # NaN beats any value, the first NaN wins
            x[r, a] = 60
            x[r, [b, vocab - 1]] = float("nan")
        elif kind == 4:
            x[r, [b, a]] = float("inf")
        elif kind == 5:
            x[r] = float("-inf")
        elif kind == 6:
            x[r] = float("nan") if r % 2 else 1.25
    if rows > 2 and step in (1, 2):
        x[step, eos[step - 1]] = 70
    return x


def _run(rows, vocab, dtype, steps=5, seed=0, strided=False, finished=None, block=None):
    finished = ((0,) if rows > 2 else ()) if finished is None else finished
    eos = [min(17, vocab - 1), vocab - 2]
    ours, ref = _state(GREEDY, rows, vocab, eos, finished=finished), _state(GREEDY, rows, vocab, eos, finished=finished)
    for step in range(steps):
        x = _logits(rows, vocab, dtype, step, seed, eos, block or ga.BLOCK_V)
        if strided:  # a slice of a wider buffer: row stride != V
            wide = torch.randn(rows, vocab + 37).to(dtype)
            wide[:, 5:5 + vocab] = x
            x = wide[:, 5:5 + vocab]
        ga.greedy_advance(x, ours)
        ga.greedy_advance_reference(x, ref)
        for name in FIELDS:
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (step, name, getattr(ours, name),
                                                                          getattr(ref, name))
    return ours


# The interpreter spends ~5 ms per program and step: batch 32 and several splits get fewer steps and dtypes.
CASES = [(r, v, d, 5) for r, v in [(1, 1000), (3, 1024), (5, 1)] for d in DTYPES] + [
    (32, 1000, torch.bfloat16, 3), (32, 1024, torch.float16, 3), (32, 1000, torch.float32, 3),
    (3, 9000, torch.float32, 3)]


@pytest.mark.parametrize("rows,vocab,dtype,steps", CASES, ids=str)
def test_bit_exact_against_the_torch_path(rows, vocab, dtype, steps):
    state = _run(rows, vocab, dtype, steps=steps, seed=rows + vocab)
    if rows > 2 and vocab > 1:  # the case did what it is meant to: eos ended rows 1 and 2, row 0 was padded
        assert state.finished[:3].all() and state.ends[1:3].tolist() == [2, 3]
        assert (state.out[0, :steps] == 3).all() and int(state.step) == steps


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (3, torch.bfloat16)], ids=str)
def test_several_tiles_and_splits_per_row(monkeypatch, rows, dtype, one_launch):
    # 2 splits of 512 columns, two 256-column tiles each (the last one partly past V), as at V > 256k;
    # finished by the last program to arrive, or by a second launch
    monkeypatch.setattr(ga, "ONE_LAUNCH", one_launch)
    monkeypatch.setattr(ga, "sm_count", lambda device, off_gpu: 6)  # 3 rows x 2 splits fit in one wave
    monkeypatch.setattr(ga, "BLOCK_V", 256)
    monkeypatch.setattr(ga, "MAX_SPLITS", 2)
    _run(rows, 1000, dtype, seed=rows, block=256)
    _run(rows, 1000, dtype, seed=rows, block=256, strided=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_logits(dtype):
    _run(3, 1000, dtype, strided=True)
    _run(8, 9000, dtype, steps=2, strided=True, finished=(0, 5, 7))


def test_full_vocab_single_row():
    _run(1, 151936, torch.bfloat16, steps=2)


def test_no_eos_and_every_row_finished():
    ours, ref = _state(GREEDY, 4, 300, []), _state(GREEDY, 4, 300, [])
    for state in (ours, ref):
        state.finished.fill_(True)
    x = torch.randn(4, 300)
    ga.greedy_advance(x, ours)
    ga.greedy_advance_reference(x, ref)
    assert all(torch.equal(getattr(ours, n), getattr(ref, n)) for n in FIELDS)
    assert (ours.tokens == 3).all() and (ours.ends == 1).all()


def _spy(monkeypatch):
    calls = []
    real = ga.greedy_advance
    monkeypatch.setattr(ga, "greedy_advance", lambda logits, state: (calls.append(1), real(logits, state)))
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_min_new_tokens_masks_eos_until_then(dtype):
    """min_new_tokens=3: eos is the row maximum (row 0) or NaN (row 1) at every step, but only from
    step 3 on may it be chosen; row 2 never sees eos."""
    kind = LoopKind(**{**GREEDY.__dict__, "min_new": True})
    rows, vocab, eos = 3, 1000, [17, 998]
    ours, ref = (_state(kind, rows, vocab, eos, min_new=3) for _ in range(2))
    for step in range(5):
        x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(step)).to(dtype)
        x[0, 998] = 90
        x[1, 17] = float("nan")
        x[1, 500] = 80
        ga.greedy_advance(x, ours)
        ga.greedy_advance_reference(x, ref)
        for name in FIELDS:
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (step, name)
    assert ours.out[0, :3].tolist() != [998] * 3 and ours.out[1, :3].tolist() == [500] * 3
    assert ours.out[0, 3] == 998 and ours.out[1, 3] == 17 and ours.ends[:2].tolist() == [4, 4]


def test_advance_takes_the_kernel_for_plain_greedy_only(monkeypatch):
    calls = _spy(monkeypatch)
    eos = [5, 9]
    x = torch.randn(3, 100)
    ours, ref = _state(GREEDY, 3, 100, eos), _state(GREEDY, 3, 100, eos)
    advance(x, ours)
    ga.greedy_advance_reference(x, ref)
    assert calls == [1] and all(torch.equal(getattr(ours, n), getattr(ref, n)) for n in FIELDS)

    others = [dict(sampling=True), dict(penalty=True)]
    for change in others:
        kind = LoopKind(**{**GREEDY.__dict__, **change})
        advance(x, _state(kind, 3, 100, eos), torch.Generator().manual_seed(0))
    advance(x, _state(GREEDY, 3, 100, eos), torch.Generator().manual_seed(0))  # a generator: torch path
    advance(x[:, ::2], _state(GREEDY, 3, 50, eos))  # column stride 2: torch path
    advance(x.double(), _state(GREEDY, 3, 100, eos))  # fp64: torch path
    assert calls == [1]
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():  # the CPU without the interpreter keeps the torch ops
        advance(x, _state(GREEDY, 3, 100, eos))
        assert calls == [1]


def test_advance_falls_back_exactly(monkeypatch):
    calls = _spy(monkeypatch)
    ours, ref = _state(GREEDY, 3, 50, [5]), _state(GREEDY, 3, 50, [5])
    x = torch.randn(3, 100)[:, ::2]
    advance(x, ours)
    loop.advance_torch(x, ref)
    assert calls == [] and all(torch.equal(getattr(ours, n), getattr(ref, n)) for n in FIELDS)


def test_bad_inputs_are_clear_errors():
    sampled = _state(LoopKind(**{**GREEDY.__dict__, "sampling": True}), 2, 10, [1])
    with pytest.raises(ValueError, match="not plain greedy"):
        ga.greedy_advance(torch.randn(2, 10), sampled)
    with pytest.raises(ValueError, match="not plain greedy"):
        ga.greedy_advance_reference(torch.randn(2, 10), sampled)
    state = _state(GREEDY, 2, 10, [1])
    for bad in (torch.randn(3, 10), torch.randn(2, 10).double(), torch.randn(2, 20)[:, ::2], torch.randn(20)):
        with pytest.raises(ValueError, match=r"needs logits \[B=2, V\]"):
            ga.greedy_advance(bad, state)


@pytest.mark.parametrize("sms,launches", [(6, 1), (5, 2)])
def test_a_grid_past_one_program_per_sm_finishes_in_a_second_launch(monkeypatch, sms, launches):
    # 3 rows x 2 splits: one wave on 6 SMs; on 5 the atomics on one counter would cost more than a launch
    monkeypatch.setattr(ga, "BLOCK_V", 256)
    monkeypatch.setattr(ga, "MAX_SPLITS", 2)
    monkeypatch.setattr(ga, "sm_count", lambda device, off_gpu: sms)
    finish, calls = ga._finish, []

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return finish[grid]

    monkeypatch.setattr(ga, "_finish", Counting())
    _run(3, 1000, torch.float32, steps=5, seed=7, block=256)  # bit for bit the torch path, either way
    assert len(calls) == (5 if launches == 2 else 0)


def _ptx_events() -> dict:
    """In a subprocess with the interpreter off: the launches as compiled for sm90, PDL on, in one launch
    and in two (``ONE_LAUNCH`` off)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_kernels_pdl import _TYPES, _events, _ptx

    _TYPES[torch.bool] = "i1"
    kernels = {name: getattr(ga, name) for name in ("_advance", "_finish")}
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, args, kwargs))

    for name in kernels:
        setattr(ga, name, Recorder(name))
    ga.pdl_enabled = lambda device: True  # the CPU tensors stand in for a Hopper GPU
    os.environ["TRITON_INTERPRET"] = "1"  # supports() accepts the CPU tensors; the kernels stay compiled
    out = {}
    ga.sm_count = lambda device, off_gpu: 132  # an H200: 3 rows x 3 splits finish in one launch
    for one in (True, False):
        ga.ONE_LAUNCH = one
        launches.clear()
        ga.greedy_advance(torch.randn(3, 9000, dtype=torch.bfloat16), _state(GREEDY, 3, 9000, [1]))
        out.update({f"{name}/{'one' if one else 'two'}": {"events": _events(_ptx(kernels[name], args, kwargs)),
                                                          "launch_pdl": kwargs.get("launch_pdl")}
                    for name, args, kwargs in launches})
    return out


def test_the_launches_compile_and_keep_the_pdl_contract():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_kernels_pdl import run_probe

    probe = run_probe(__file__)
    assert sorted(probe) == ["_advance/one", "_advance/two", "_finish/two"]
    for name, got in probe.items():
        events = got["events"]
        # nothing is loaded or stored before the wait, and the release follows it
        assert got["launch_pdl"] is True, name
        assert events[:2] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"], (name, events[:4])
        assert events.count("griddepcontrol.wait") == events.count("griddepcontrol.launch_dependents") == 1
        assert any(e.startswith("st.global") for e in events), name
    # one launch: the arrival is counted after the partials are stored, and the finish follows it
    one = probe["_advance/one"]["events"]
    arrival = next(i for i, e in enumerate(one) if e.startswith("atom.global"))
    assert any(e.startswith("st.global") for e in one[:arrival])
    assert any(e.startswith("ld.global") for e in one[arrival:])
    assert not any(e.startswith("atom.global") for e in probe["_advance/two"]["events"])


if __name__ == "__main__":
    print(json.dumps(_ptx_events()))
