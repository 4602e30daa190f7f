"""A CUDA-graph capture collects dead cycles first and runs with the collector off (torch's own
capture no longer collects, so an earlier graph could be destroyed in the middle of it)."""

import contextlib
import gc
import weakref

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


def test_dead_cycles_are_collected_before_the_capture(fake_capture):
    gc.disable()  # no automatic collection: only capturing() can free the cycle below
    dead = _Cycle()
    ref = weakref.ref(dead)
    del dead
    assert ref() is not None  # a cycle: reference counting alone does not free it
    with cuda_graphs.capturing("g", pool="p"):
        assert ref() is None
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
