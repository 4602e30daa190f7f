"""Attention backends by name. ``attn_implementation`` picks one; unsupported requests raise.

A backend declares what it supports and implements two entry points:

* ``prefill(q, k, v, batch, scale, window)``: sequences whose keys are exactly their new tokens
  (no cached context): varlen causal attention over the flat ``[T, H, D]`` tensors.
* ``with_cache(q, k_cache, v_cache, batch, scale, window)``: queries attend to everything their
  sequence has in the paged cache (decode, chunked prefill, prefix hits), bottom-right causal.

``AttentionBackend.__call__`` writes the new k/v to the cache first (unless the caller already did:
``kv_stored``, see ``layers.attention.ApplyRotary``) and routes between the two.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedError
from .kv_cache import store_kv
from .metadata import AttentionBatch

logger = logging.getLogger("cudaformers")


@dataclass
class Capabilities:
    devices: frozenset = frozenset({"cuda", "cpu"})
    dtypes: frozenset = frozenset({torch.float32, torch.float16, torch.bfloat16})
    head_dims: frozenset | None = None  # None: any
    sliding_window: bool = True
    backward: bool = True
    paged_cache: bool = True
    notes: list[str] = field(default_factory=list)


class AttentionBackend:
    name: str = ""
    caps = Capabilities()
    # True when a decode step through ``with_cache`` makes no host reads and keeps fixed shapes, so
    # it can be captured in a CUDA graph.
    graph_safe: bool = False

    def available(self) -> str | None:
        """None when usable in this process, else why not (a missing package, no GPU...)."""
        return None

    def unsupported_reason(self, *, device: torch.device, dtype: torch.dtype, head_dim: int,
                           sliding_window: int | None, training: bool) -> str | None:
        why = self.available()
        if why:
            return why
        c = self.caps
        if device.type not in c.devices:
            return f"runs on {sorted(c.devices)}, not {device.type}"
        if dtype not in c.dtypes:
            return f"supports dtypes {sorted(str(d).removeprefix('torch.') for d in c.dtypes)}, not {str(dtype).removeprefix('torch.')}"
        if c.head_dims is not None and head_dim not in c.head_dims:
            return f"supports head_dim {sorted(c.head_dims)}, not {head_dim}"
        if sliding_window and not c.sliding_window:
            return "has no sliding-window attention"
        if training and not c.backward:
            return "has no backward pass (inference only)"
        return None

    def __call__(self, q, k, v, batch: AttentionBatch, layer_idx: int, scale: float, window: int | None,
                 kv_stored: bool = False):
        cache = batch.kv_cache
        if cache is not None:
            if not kv_stored:
                store_kv(cache.k[layer_idx], cache.v[layer_idx], k, v, batch.slot_mapping)
            if batch.has_context:
                return self.with_cache(q, cache.k[layer_idx], cache.v[layer_idx], batch, scale, window)
        return self.prefill(q, k, v, batch, scale, window)

    def prefill(self, q, k, v, batch, scale, window):
        raise NotImplementedError

    def with_cache(self, q, k_cache, v_cache, batch, scale, window):
        raise NotImplementedError


_BACKENDS: dict[str, AttentionBackend] = {}
_ALIASES: dict[str, str] = {}


def register(backend: AttentionBackend, *aliases: str) -> AttentionBackend:
    _BACKENDS[backend.name] = backend
    for a in aliases:
        _ALIASES[a] = backend.name
    return backend


def _load_builtin():
    # Import for the side effect of registration; cheap, and kept here so the registry is complete
    # whoever asks first.
    from . import eager, sdpa  # noqa: F401

    for optional in ("triton_backend", "flash", "flex"):
        try:
            __import__(f"{__package__}.{optional}")
        except ImportError as e:  # a backend module itself missing is a packaging bug, say so
            if f"{__package__}.{optional}" in str(e):
                continue
            raise


def names() -> list[str]:
    _load_builtin()
    return sorted(_BACKENDS) + sorted(_ALIASES)


def get_backend(name: str, *, device: torch.device, dtype: torch.dtype, head_dim: int,
                sliding_window: int | None = None, training: bool = False) -> AttentionBackend:
    """The backend called ``name``, checked against this model; an error lists what would work."""
    _load_builtin()
    resolved = _ALIASES.get(name, name)
    backend = _BACKENDS.get(resolved)
    if backend is None:
        raise UnsupportedError(f"unknown attn_implementation {name!r}; choose one of {names()}")
    if hasattr(backend, "resolve"):
        # Backends such as flash_attention_2 stand in for an external package when it is absent.
        backend = backend.resolve(device=device)
    why = backend.unsupported_reason(device=device, dtype=dtype, head_dim=head_dim,
                                     sliding_window=sliding_window, training=training)
    if why:
        ok = [n for n, b in sorted(_BACKENDS.items()) if not b.unsupported_reason(
            device=device, dtype=dtype, head_dim=head_dim, sliding_window=sliding_window, training=training)]
        raise UnsupportedError(
            f"attn_implementation={name!r} cannot run this model: it {why} "
            f"(device {device.type}, dtype {str(dtype).removeprefix('torch.')}, head_dim {head_dim}"
            f"{', sliding window' if sliding_window else ''}{', training' if training else ''}). "
            f"Backends that would work: {ok}")
    return backend
