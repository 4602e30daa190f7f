"""A process-wide count of changes to module trees, for what is cached against a model's structure.

generate() keeps CUDA graphs, and the checks that decide whether to capture them, across calls. A
graph replays the modules, kernels and attention backend it captured, so it must not outlive a
change to them: a submodule or parameter registered anywhere (adapters, quantization, parallelism,
a user's own swap) moves the count through torch's global registration hooks, and the transforms
that rebind a forward or a backend without registering anything (kernels, attention backends,
checkpointing) call ``changed()``. A cache keyed by ``epoch()`` is rebuilt after any change, at the
cost of a recapture when some other model changed.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

_count = [0]


def epoch() -> int:
    return _count[0]


def changed() -> None:
    """Marks every cached structure stale."""
    _count[0] += 1


def _registered(*_args) -> None:
    # Inside torch.compile's tracing a registration builds a temporary (transformers slices its
    # ModuleList of layers in every forward), not a change to a live model; counting it would make the
    # compiled code guard on the count and compile again at every call (transformers' static-cache
    # generate fell from 264 to 25 tok/s with cudaformers imported, bench/RESULTS.md run 20).
    if not torch.compiler.is_compiling():
        changed()


_module.register_module_module_registration_hook(_registered)
_module.register_module_parameter_registration_hook(_registered)
