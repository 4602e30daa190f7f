"""The L2 prefetch plan (kernels/l2_prefetch.py): the order recorded on a warm-up step, cyclic, per
tensor identity, with no reference that keeps a model alive. The kernels' prefetch instructions are
checked in the sm90 PTX by test_kernels_pdl.py and for unchanged results on the GPU."""

import gc

import torch

from cudaformers.kernels import l2_prefetch


def test_recorded_order_is_planned_cyclically():
    a, b, c = (torch.zeros(4) for _ in range(3))
    with l2_prefetch.recording():
        for t in (a, b, c):
            assert l2_prefetch.after(t) is None  # nothing planned before the step ends
    assert l2_prefetch.after(a) is b and l2_prefetch.after(b) is c
    assert l2_prefetch.after(c) is a  # the next step starts again with a


def test_a_view_at_the_same_address_is_not_the_planned_tensor():
    a, b = torch.zeros(8), torch.zeros(8)
    l2_prefetch.plan([a, b])
    assert l2_prefetch.after(a[:4]) is None  # same data_ptr, another tensor
    assert l2_prefetch.after(a) is b


def test_plan_holds_no_strong_references():
    a, b = torch.zeros(8), torch.zeros(8)
    l2_prefetch.plan([a, b])
    key = b.data_ptr()
    del b
    gc.collect()
    assert l2_prefetch.after(a) is None  # its successor is gone: nothing to prefetch
    l2_prefetch.plan([])
    assert key not in l2_prefetch._plan  # dead entries are dropped at the next plan


def test_nested_recording_keeps_the_outer_order():
    a, b, c = (torch.zeros(2) for _ in range(3))
    with l2_prefetch.recording():
        l2_prefetch.after(a)
        with l2_prefetch.recording():
            l2_prefetch.after(c)
        l2_prefetch.after(b)
    assert l2_prefetch.after(a) is b and l2_prefetch.after(b) is a


def test_window_and_lines():
    assert l2_prefetch.lines(None) == 0
    assert l2_prefetch.lines(torch.zeros(100, dtype=torch.bfloat16)) == 2  # 200 bytes: two 128-byte lines
    big = torch.empty(l2_prefetch.WINDOW, dtype=torch.uint8)
    assert l2_prefetch.lines(torch.cat([big, big])) == l2_prefetch.WINDOW // l2_prefetch.LINE


def test_window_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUDAFORMERS_L2_PREFETCH_BYTES", "1024")
    assert l2_prefetch.lines(torch.zeros(1 << 20, dtype=torch.uint8)) == 8


def test_enabled_only_on_request_on_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("CUDAFORMERS_L2_PREFETCH", raising=False)
    assert not l2_prefetch.enabled(torch.device("cuda", 0))  # off by default (measured slower)
    monkeypatch.setenv("CUDAFORMERS_L2_PREFETCH", "1")
    assert not l2_prefetch.enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not l2_prefetch.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("CUDAFORMERS_L2_PREFETCH", "0")
    assert not l2_prefetch.enabled(torch.device("cuda", 0))


def test_kernels_get_no_prefetch_where_disabled():
    w, nxt = torch.zeros(4, 4), torch.zeros(4, 4)
    l2_prefetch.plan([w, nxt])
    t, n, _ = l2_prefetch.kernel_args(w)  # CPU: disabled
    assert t.dtype == torch.uint8 and n == 0
