"""A function bound to a module as one of its own attributes, without a reference cycle.

Kernels, packed projections and activation checkpointing replace a module's ``forward`` (or
``project_qkv``) with a function bound to that module. A ``types.MethodType`` stored on its own
``self`` is a cycle (module -> method -> module), so every such module, and the weights, packed
matrices and KV caches it holds, outlived ``del model`` until the garbage collector ran, maybe inside
a later CUDA-graph capture (on an H100 a dropped tiny model kept its packed q/k/v and gate/up
matrices: bench/RESULTS.md run 35). ``bind`` holds the module weakly; ``__func__`` is what callers
compare, as with a method.
"""

from __future__ import annotations

import copy
import weakref

from torch import nn


class WeakMethod:
    """``fn(module, *args)`` for a module that stores this callable on itself."""

    def __init__(self, fn, module: nn.Module):
        self.__func__ = fn
        self._module = weakref.ref(module)

    @property
    def __self__(self) -> nn.Module | None:
        return self._module()

    def __call__(self, *args, **kwargs):
        module = self._module()
        if module is None:
            raise ReferenceError(f"{self.__func__.__qualname__} was bound to a module that has since been freed: "
                                 "call it through the module (module.forward(...)), which keeps the module alive")
        return self.__func__(module, *args, **kwargs)

    def __deepcopy__(self, memo):
        # the copy binds to the module's copy (already in ``memo`` while the module's state is copied)
        return WeakMethod(self.__func__, copy.deepcopy(self._module(), memo))

    def __repr__(self) -> str:
        name = getattr(self.__func__, "__qualname__", self.__func__)
        return f"<weakly bound {name} of {type(self.__self__).__name__}>"


def bind(fn, module: nn.Module) -> WeakMethod:
    """``fn`` as a method of ``module``, to be stored on ``module`` itself."""
    return WeakMethod(fn, module)
