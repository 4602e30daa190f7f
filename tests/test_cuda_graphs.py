"""A CUDA-graph capture runs with the garbage collector off (torch's own capture no longer collects
first, so an automatic collection could destroy an earlier graph in the middle of it)."""

import contextlib
import gc

import pytest
import torch

from cudaformers import cuda_graphs


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def fake_capture(monkeypatch):
    """``torch.cuda.graph`` stood in for on the CPU: records the collector's state inside it."""
    seen = {}

    @contextlib.contextmanager
    def graph(g, pool=None):
        seen.update(enabled=gc.isenabled(), pool=pool, graph=g)
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    enabled = gc.isenabled()
    gc.enable()
    yield seen
    if not enabled:
        gc.disable()


def test_no_collection_runs_inside_the_capture(fake_capture):
    starts, watching = [], []

    def record(phase, info):
        if phase == "start" and watching:
            starts.append(info["generation"])

    def allocate_cycles():
        watching.append(True)
        junk = [_Cycle() for _ in range(200)]
        watching.clear()
        return junk

    threshold = gc.get_threshold()
    gc.callbacks.append(record)
    gc.set_threshold(1)  # every allocation may start a collection
    try:
        allocate_cycles()
        assert starts  # outside a capture the collector runs
        starts.clear()
        with cuda_graphs.capturing("g", pool="p"):
            allocate_cycles()
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
    assert starts == []
    assert fake_capture == dict(enabled=False, pool="p", graph="g")


def test_the_collector_is_off_inside_the_capture_and_back_on_after(fake_capture):
    with cuda_graphs.capturing("g"):
        assert not gc.isenabled()
    assert fake_capture["enabled"] is False and gc.isenabled()


def test_the_collector_is_restored_after_an_error_and_left_off_if_it_was(fake_capture):
    with pytest.raises(RuntimeError):
        with cuda_graphs.capturing("g"):
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    with cuda_graphs.capturing("g"):
        pass
    assert not gc.isenabled()
    gc.enable()


def test_warm_ups_share_one_side_stream_per_gpu(monkeypatch):
    """torch keeps a cuBLAS workspace for each stream cuBLAS ran on until the process ends: a stream
    made per capture kept ~64 MiB each (bench/RESULTS.md run 34). One stream per GPU, then."""
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda_graphs._side_stream.cache_clear()
    try:
        first = cuda_graphs.warmup_stream(torch.device("cuda", 0))
        assert cuda_graphs.warmup_stream(torch.device("cuda", 0)) is first
        assert cuda_graphs.warmup_stream(torch.device("cuda", 1)) is not first
        assert cuda_graphs.warmup_stream(torch.device("cuda")) is cuda_graphs.warmup_stream(torch.device("cuda", 1))
        assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
    finally:
        cuda_graphs._side_stream.cache_clear()
