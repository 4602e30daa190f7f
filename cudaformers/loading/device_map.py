"""``device_map``: which device each part of the model lives on, and moving activations between them.

Accepted: None / "cpu" / "cuda" / "cuda:N" / an int / a torch.device (one device), a dict of module
prefix -> device, and "auto" (alias "balanced", "sequential") which spreads decoder layers over the
visible GPUs by free memory (or ``max_memory``), then the CPU.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")
AUTO = ("auto", "balanced", "sequential")


def _device(value) -> torch.device:
    from ..device import resolve_device

    return resolve_device(value)


def placement_units(model: nn.Module) -> list[str]:
    """The module prefixes that are placed as a whole, in forward order."""
    units = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(len(model.model.layers))]
    return units + ["model.norm", "lm_head"]


def _unit_bytes(model: nn.Module, prefix: str, element_size: int) -> int:
    # Packed (quantized) parameters keep their own element size; float ones take the model dtype's.
    return sum(p.numel() * (element_size if p.is_floating_point() else p.element_size())
               for p in model.get_submodule(prefix).parameters())


def _parse_bytes(v) -> int:
    if isinstance(v, (int, float)):
        return int(v)
    s = str(v).strip().upper().replace("IB", "B")
    for unit, mult in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def plan(model: nn.Module, device_map, dtype: torch.dtype, max_memory: dict | None = None) -> dict[str, torch.device]:
    """Resolve ``device_map`` to {module prefix: device} covering every parameter."""
    if device_map is None:
        return {"": torch.device("cpu")}
    if isinstance(device_map, (int, torch.device)) or (isinstance(device_map, str) and device_map not in AUTO):
        return {"": _device(device_map)}
    if isinstance(device_map, dict):
        placement = {k: _device(v) for k, v in device_map.items()}
        uncovered = [n for n, _ in model.named_parameters()
                     if not any(n == k or n.startswith(k + ".") or k == "" for k in placement)]
        if uncovered:
            raise UnsupportedError(f"device_map does not place {len(uncovered)} parameters, e.g. {uncovered[:3]}; "
                                   "add their module prefixes (or '' for the rest)")
        return placement
    if device_map not in AUTO:
        raise UnsupportedError(f"device_map={device_map!r} is not supported; use 'auto', a device or a dict")
    return _plan_auto(model, dtype, max_memory or {})


def _plan_auto(model, dtype, max_memory) -> dict[str, torch.device]:
    elem = torch.empty((), dtype=dtype).element_size()
    units = placement_units(model)
    sizes = {u: _unit_bytes(model, u, elem) for u in units}
    gpus = list(range(torch.cuda.device_count()))
    budgets = []
    for i in gpus:
        if i in max_memory or f"cuda:{i}" in max_memory:
            budgets.append(_parse_bytes(max_memory.get(i, max_memory.get(f"cuda:{i}"))))
        else:
            free, _ = torch.cuda.mem_get_info(i)
            budgets.append(int(free * 0.9))  # headroom for activations and the KV cache
    if not gpus:
        logger.info("device_map='auto': no GPU visible, placing the model on the CPU")
        return {"": torch.device("cpu")}
    total = sum(sizes.values())
    # Balanced: aim for an equal share per GPU (capped by its budget) so later layers' GPUs are not idle.
    share = -(-total // len(gpus))
    placement, gpu, used = {}, 0, 0
    tied = getattr(model.config, "tie_word_embeddings", False)
    for unit in units:
        if unit == "lm_head" and tied:
            placement[unit] = placement["model.embed_tokens"]
            continue
        while gpu < len(gpus) and (used + sizes[unit] > budgets[gpu] or (used > 0 and used + sizes[unit] > share * 1.05
                                                                        and gpu < len(gpus) - 1)):
            gpu, used = gpu + 1, 0
        if gpu < len(gpus):
            placement[unit] = torch.device("cuda", gpus[gpu])
            used += sizes[unit]
        else:
            if "cpu" in max_memory and sum(sizes[u] for u, d in placement.items() if d.type == "cpu") + sizes[unit] \
                    > _parse_bytes(max_memory["cpu"]):
                raise UnsupportedError("device_map='auto': the model does not fit in max_memory; raise the limits "
                                       "or quantize the model (quantization_config=...)")
            placement[unit] = torch.device("cpu")
    summary = {}
    for unit, dev in placement.items():
        summary.setdefault(str(dev), []).append(unit)
    logger.info("device_map='auto': %s", "; ".join(f"{d}: {len(u)} modules" for d, u in summary.items()))
    return placement


def device_of(name: str, placement: dict[str, torch.device]) -> torch.device:
    """The device of a parameter or module name under ``placement`` (longest prefix wins)."""
    best, best_len = None, -1
    for prefix, dev in placement.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = dev, len(prefix)
    return best


def _move(x, device):
    from ..attention.metadata import AttentionBatch

    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, AttentionBatch):
        return x.to(device)
    return x


def install_device_hooks(model: nn.Module, placement: dict[str, torch.device]) -> None:
    """When the model spans devices, move each unit's inputs to its device before it runs."""
    if len({str(d) for d in placement.values()}) < 2:
        return
    for unit in placement_units(model):
        module = model.get_submodule(unit)
        dev = device_of(unit, placement)

        def hook(mod, args, kwargs, dev=dev):
            if dev.type == "cuda":
                # Triton (and other extensions) launch on the current device, not the tensors': a unit on
                # another GPU runs with its GPU current, and the caller's comes back after it.
                mod._caller_device = torch.cuda.current_device()
                torch.cuda.set_device(dev)
            return tuple(_move(a, dev) for a in args), {k: _move(v, dev) for k, v in kwargs.items()}

        def restore(mod, args, output):
            caller = mod.__dict__.pop("_caller_device", None)
            if caller is not None:
                torch.cuda.set_device(caller)

        module.register_forward_pre_hook(hook, with_kwargs=True)
        module.register_forward_hook(restore)
