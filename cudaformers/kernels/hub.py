"""``use_kernels`` / ``KernelConfig``: which layers of a built model run a Triton kernel.

A layer type (``"RMSNorm"``, ``"rotary_pos_emb"``, ``"SiluAndMul"``...) maps to a kernel name from the
bundled registry (``"cudaformers:rms_norm"``), or per device type and optionally per mode::

    KernelConfig(kernel_mapping={"RMSNorm": "cudaformers:rms_norm",
                                 "SiluAndMul": {"cuda": "cudaformers:act_and_mul", "cpu": ""},
                                 "ForCausalLMLoss": {"cuda": {"training": "cudaformers:fused_linear_cross_entropy",
                                                              "inference": ""}}})

An empty value keeps the plain PyTorch layer. Layer types left out get the default for the device
(``inherit_mapping=True``): every kernel on CUDA, plain PyTorch on CPU. A kernel swap replaces the
module's ``forward`` on the instance, so parameters, names and types are untouched and the swap is
undone by deleting it; ``model.train()`` / ``.eval()`` re-resolve the mapping for the new mode.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ..binding import bind
from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")
MODES = ("inference", "training")


# -- the bundled kernels, as forwards bound onto existing modules ---------------------------------

def _rms_norm(self, x, residual=None):
    import torch

    from .rms_norm import rms_norm

    # Under autocast every consumer of a norm (projections, attention) casts it to the autocast
    # dtype: the kernel writes that dtype directly instead of fp32 (fp32 master weights) plus casts.
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return rms_norm(x, self.weight, self.variance_epsilon, residual, out_dtype)


def _rotary(self, q, k, cos, sin, q_norm=None, k_norm=None, kv_store=None):
    from .rotary import apply_rotary

    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary(q, k, cos, sin)
    if kv_store is not None:  # ApplyRotary's contract: the cache holds k and v on return
        kv_store.store(k)
    return q, k


def _qk_norm_rope(self, q, k, cos, sin, q_norm=None, k_norm=None, kv_store=None):
    from .qk_norm_rope import qk_norm_rope

    return qk_norm_rope(q, k, cos, sin, q_norm, k_norm, kv_store)


def _act_and_mul(self, gate, up):
    from .activation import act_and_mul

    return act_and_mul(gate, up, self.name)


def _runs_act_kernel(act) -> bool:
    """Whether ``act`` (a GatedActivation) runs exactly the act-and-mul kernel: that kernel's forward,
    no hooks a fused launch would bypass."""
    return (getattr(act.__dict__.get("forward"), "__func__", None) is _act_and_mul
            and not act._forward_hooks and not act._forward_pre_hooks)


def _linear(self, x):
    from .gemv import linear
    from .skinny_gemm import skinny_applies, skinny_linear

    if skinny_applies(self.weight, x):  # 5-32 rows: small decode batches, on tensor cores
        return skinny_linear(x, self.weight, self.bias)
    return linear(x, self.weight, self.bias)


def _is_plain_linear(module) -> bool:
    import torch.nn as nn

    from .fused_projections import PackedLinear

    return type(module) in (nn.Linear, PackedLinear)  # not quantized, adapter or sharded layers


def _is_gated_mlp(module) -> bool:
    from ..layers.mlp import GatedMLP

    # Exact forward only: a subclass that changes the MLP's math keeps its own forward.
    return (isinstance(module, GatedMLP) and type(module).forward is GatedMLP.forward
            and module.act_fn.name in _SILU + _GELU)


def _streams_plainly(linear) -> bool:
    """A Linear whose forward is exactly ``F.linear`` on its own dense weight: no quantization,
    adapter, tensor-parallel sharding (DTensor weights, hooks) or other wrapper to bypass."""
    import torch
    import torch.nn as nn

    return (type(linear) is nn.Linear and type(linear.weight) in (nn.Parameter, torch.Tensor)
            and not linear._forward_hooks and not linear._forward_pre_hooks)


def gated_mlp_down(mlp, gate, up):
    """A gated MLP past its gate/up projections, with ``act(gate) * up`` inside the down projection's
    GEMV where that takes the rows (1-4). At 5-32 rows the skinny GEMM's tensor-core loop is
    better fed by a separate act-and-mul launch: building the input tiles inside it cost W3 9%
    (bench/RESULTS.md run 11)."""
    from .gemv import gemv_act_mul, gemv_applies

    down = mlp.down_proj
    if _streams_plainly(down) and gemv_applies(down.weight, gate, up):
        return gemv_act_mul(gate, up, down.weight, down.bias, mlp.act_fn.name)
    return down(mlp.act_fn(gate, up))  # GatedMLP.forward, past the projections


GATED_SKINNY = True  # off: the gate/up launch and the act-and-mul launch (A/B runs)


def _gated_skinny(mlp, x):
    """``act(gate) * up`` from one skinny launch (``skinny_gated``) at 5-32 rows, where the unfused path
    would run exactly that: the packed gate/up projection on the skinny GEMM, then the act-and-mul
    kernel. None elsewhere."""
    from .fused_norm_decode import _packed
    from .skinny_gemm import skinny_applies, skinny_gated

    if not GATED_SKINNY:
        return None
    packed = _packed(mlp, "packed_gate_up", (mlp.gate_proj, mlp.up_proj))
    act = mlp.act_fn
    if packed is None or getattr(packed.__dict__.get("forward"), "__func__", None) is not _linear:
        return None
    if not _runs_act_kernel(act):
        return None
    if packed.sizes[0] * 2 != packed.weight.shape[0] or not skinny_applies(packed.weight, x):
        return None
    return skinny_gated(x, packed.weight, packed.bias, act.name)


def _gated_quant(mlp, x):
    """``act(gate) * up`` from one fragment-GEMV launch (``quant_gemv_mma``'s ``act``) for one row of a
    quantized model whose gate/up projections are packed, where the unfused path would run exactly
    that GEMV and then the act-and-mul kernel, for the formats of ``quant_gemv_plans.gated_formats``. None
    elsewhere."""
    from . import quant_gemv_mma, quant_gemv_plans, quant_matmul

    gated = quant_gemv_plans.gated_formats(x.device)
    if not (gated and quant_matmul.USE_MMA and quant_matmul.USE_FRAGMENT_GEMV):
        return None  # (no format gated)
    from ..quant.packing import PackedQuantLinear
    from .fused_norm_decode import _unhooked

    packed = getattr(mlp, "packed_gate_up", None)
    if not (isinstance(packed, PackedQuantLinear) and packed.usable_for(mlp.gate_proj) and _unhooked(packed)
            and _runs_act_kernel(mlp.act_fn)):
        return None
    layer = packed.layer
    if packed.sizes[0] * 2 != layer.out_features or x.dtype != layer.compute_dtype or x.numel() != layer.in_features:
        return None
    x2, w = layer.ordered_input(x.reshape(1, -1)), layer.packed()
    if w.fmt not in gated or not quant_gemv_mma.supports(x2, w):
        return None
    h = quant_gemv_mma.quant_gemv_mma(x2, w, layer.bias, act=mlp.act_fn.name)
    return h.view(*x.shape[:-1], packed.sizes[0])


def _fused_mlp_decode(self, x):
    h = _gated_quant(self, x)
    if h is None:
        h = _gated_skinny(self, x)
    if h is not None:
        return self.down_proj(h)
    return gated_mlp_down(self, *self.project_gate_up(x))


def _fused_norm_decode(self, hidden, residual, cos, sin, batch):
    from .fused_norm_decode import fused_norm_decode_forward

    return fused_norm_decode_forward(self, hidden, residual, cos, sin, batch)


def _is_dense_decoder_layer(module) -> bool:
    from ..models.llama import DecoderLayer

    # The exact class (subclasses such as the MoE layers change the feed-forward); a forward that
    # something else patched (block checkpointing) is left alone, and so never popped by a swap.
    bound = module.__dict__.get("forward")
    return type(module) is DecoderLayer and (bound is None or getattr(bound, "__func__", None) is _fused_norm_decode)


def _gated_mlp_recompute(self, x):
    import torch

    from ..layers.mlp import GatedMLP
    from .gated_mlp import recomputed_gated_mlp

    projections = (self.gate_proj, self.up_proj, self.down_proj)
    if torch.is_grad_enabled() and all(_streams_plainly(m) for m in projections):
        return recomputed_gated_mlp(x, *projections, self.act_fn)
    return GatedMLP.forward(self, x)  # no grad (evaluation) or wrapped projections (LoRA, FSDP, TP)


def _moe_experts(self, hidden, top_k_index, top_k_weights):
    from .moe import moe_experts

    return moe_experts(hidden, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, self.act)


def _moe_router(self, hidden):
    import torch.nn.functional as F

    from .moe import route

    return route(F.linear(hidden, self.weight), self.top_k, self.renormalize)


def _selective_scan(self, *args, **kwargs):
    from .mamba import selective_scan

    return selective_scan(*args, **kwargs)


def _causal_conv1d(self, x, state=None):
    from .mamba import causal_conv1d

    y, state = causal_conv1d(x, self.weight, self.bias, state, silu=self.fuse_silu)
    return (y if self.fuse_silu else self.act(y)), state


@dataclass(frozen=True)
class LayerType:
    name: str
    matches: object               # module -> bool
    kernels: dict                 # kernel name -> forward to bind (None: installed on the model itself)
    about: str
    default_modes: tuple = MODES  # modes in which CUDA gets the kernel by default
    has_backward: bool = True     # False: the kernels are forward-only, never used in training
    forward_only: tuple = ()      # kernels of a layer type that otherwise has a backward
    mode_defaults: dict = field(default_factory=dict)  # mode -> default kernel, where not the first one


def _is(cls_path: str, **attrs):
    def check(module) -> bool:
        module_path, _, cls_name = cls_path.rpartition(".")
        cls = getattr(__import__(module_path, fromlist=[cls_name]), cls_name)
        return isinstance(module, cls) and all(getattr(module, k, None) in v for k, v in attrs.items())
    return check


def _tagged(tag: str):
    return lambda module: getattr(module, "kernel_layer_name", None) == tag


_SILU, _GELU = ("silu", "swish"), ("gelu", "gelu_pytorch_tanh", "gelu_new")
LAYER_TYPES = {t.name: t for t in [
    LayerType("RMSNorm", _is("cudaformers.layers.norm.RMSNorm"), {"cudaformers:rms_norm": _rms_norm},
              "RMSNorm with the residual add fused in"),
    LayerType("rotary_pos_emb", _is("cudaformers.layers.attention.ApplyRotary"),
              {"cudaformers:rotary": _rotary, "cudaformers:qk_norm_rope": _qk_norm_rope},
              "q/k norm + rotary: one launch for both in inference (qk_norm_rope, which also writes k and v to "
              "the KV cache), in place with a backward in training (rotary)",
              forward_only=("cudaformers:qk_norm_rope",), mode_defaults={"inference": "cudaformers:qk_norm_rope"}),
    LayerType("SiluAndMul", _is("cudaformers.layers.mlp.GatedActivation", name=_SILU),
              {"cudaformers:act_and_mul": _act_and_mul}, "silu(gate) * up"),
    LayerType("GeluAndMul", _is("cudaformers.layers.mlp.GatedActivation", name=_GELU),
              {"cudaformers:act_and_mul": _act_and_mul}, "gelu(gate) * up (tanh or erf)"),
    LayerType("Linear", _is_plain_linear, {"cudaformers:gemv": _linear},
              "decode-sized matmuls as weight-streaming kernels (a GEMV up to 4 rows, a skinny tensor-core GEMM "
              "for 5-32); larger ones stay on cuBLAS",
              default_modes=("inference",)),
    LayerType("GatedMLP", _is_gated_mlp,
              {"cudaformers:fused_mlp_decode": _fused_mlp_decode, "cudaformers:gated_mlp_recompute": _gated_mlp_recompute},
              "inference: act(gate) * up fused into the down projection's GEMV at 1-4 rows, into the "
              "gate/up skinny GEMM's epilogue at 5-32 rows; training: "
              "act(gate) * up recomputed in the backward instead of saved",
              forward_only=("cudaformers:fused_mlp_decode",),
              mode_defaults={"inference": "cudaformers:fused_mlp_decode", "training": "cudaformers:gated_mlp_recompute"}),
    LayerType("DecoderLayer", _is_dense_decoder_layer, {"cudaformers:fused_norm_decode": _fused_norm_decode},
              "decode-sized dense decoder layers (<= 4 rows): each RMSNorm (and its residual add) computed inside "
              "the packed q/k/v or gate/up GEMV that consumes it",
              default_modes=("inference",), has_backward=False),
    LayerType("ForCausalLMLoss", lambda m: hasattr(m, "fused_loss") and hasattr(m, "lm_head"),
              {"cudaformers:fused_linear_cross_entropy": None},
              "lm_head + cross-entropy without the full logits", default_modes=("training",)),
    LayerType("MoeRouter", _tagged("MoeRouter"), {"cudaformers:topk_softmax": _moe_router},
              "MoE softmax + top-k routing, with a backward (default in inference; map it for training)",
              default_modes=("inference",)),
    LayerType("MoeExperts", _tagged("MoeExperts"), {"cudaformers:grouped_gemm": _moe_experts},
              "MoE experts as one grouped GEMM over all experts"),
    LayerType("selective_scan_fn", _tagged("selective_scan_fn"), {"cudaformers:selective_scan": _selective_scan},
              "Mamba selective scan, with a chunked reverse-scan backward"),
    LayerType("causal_conv1d_fn", _tagged("causal_conv1d_fn"), {"cudaformers:causal_conv1d": _causal_conv1d},
              "Mamba causal depthwise conv1d (+ SiLU), forward and backward"),
]}


@dataclass
class KernelConfig:
    """Which kernel each layer type gets; see the module docstring for the mapping format."""

    kernel_mapping: dict = field(default_factory=dict)
    use_local_kernel: bool = False
    inherit_mapping: bool = True

    def __post_init__(self):
        if not isinstance(self.kernel_mapping, dict):
            raise UnsupportedError(f"kernel_mapping must be a dict of layer type -> kernel, got "
                                   f"{type(self.kernel_mapping).__name__}")
        for layer, value in self.kernel_mapping.items():
            if layer not in LAYER_TYPES:
                raise UnsupportedError(f"kernel_mapping: unknown layer type {layer!r}; known: {', '.join(LAYER_TYPES)}")
            for device, per_mode in (value.items() if isinstance(value, dict) else [(None, value)]):
                for mode, name in (per_mode.items() if isinstance(per_mode, dict) else [(None, per_mode)]):
                    if mode is not None and mode not in MODES:
                        raise UnsupportedError(f"kernel_mapping[{layer!r}][{device!r}]: mode {mode!r} is not "
                                               f"one of {MODES}")
                    _check_name(layer, name)


def _check_name(layer: str, name) -> None:
    if isinstance(name, tuple):  # transformers' ("org/repo:Layer", {"version": ...}) form
        name = name[0]
    if not isinstance(name, str):
        raise UnsupportedError(f"kernel_mapping[{layer!r}]: expected a kernel name string, got {name!r}")
    if name == "" or name in LAYER_TYPES[layer].kernels:
        return
    if name.startswith("cudaformers:"):
        raise UnsupportedError(f"kernel_mapping[{layer!r}] = {name!r} is not a bundled kernel for {layer}; "
                               f"available: {', '.join(LAYER_TYPES[layer].kernels)} (or '' for plain PyTorch)")
    if "/" in name and ":" in name:
        try:
            import kernels  # noqa: F401
        except ImportError:
            raise UnsupportedError(f"kernel_mapping[{layer!r}] = {name!r} names a Hub kernel repo, which needs "
                                   "the `kernels` package (pip install kernels) and network access") from None
        raise UnsupportedError(f"kernel_mapping[{layer!r}] = {name!r} names a Hub kernel repo: cudaformers runs "
                               f"its bundled Triton kernels only; use {', '.join(LAYER_TYPES[layer].kernels)} (same layer, no "
                               "download) or '' for plain PyTorch")
    raise UnsupportedError(f"kernel_mapping[{layer!r}] = {name!r} is neither a bundled kernel "
                           f"({', '.join(LAYER_TYPES[layer].kernels)}) nor a Hub repo 'org/repo:Layer'")


# -- resolution: (layer type, device type, mode) -> (kernel name or "", reason) --------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve(layer: str, device_type: str, mode: str, config: KernelConfig | None) -> tuple[str, str]:
    lt = LAYER_TYPES[layer]
    mapping = config.kernel_mapping if config is not None else {}
    if layer in mapping:
        value = mapping[layer]
        if isinstance(value, dict):
            if device_type not in value:
                return "", f"the mapping has no entry for {device_type}"
            value = value[device_type]
        if isinstance(value, dict):
            if mode not in value:
                return "", f"the mapping has no entry for {device_type}/{mode}"
            value = value[mode]
        name = value[0] if isinstance(value, tuple) else value
        if not name:
            return "", "mapped to '' (plain PyTorch)"
        if mode == "training" and (not lt.has_backward or name in lt.forward_only):
            raise UnsupportedError(f"kernel_mapping[{layer!r}] = {name!r} in training: that kernel has no backward; "
                                   f"map {layer} to {{'{device_type}': {{'inference': {name!r}, 'training': ''}}}}")
        if device_type != "cuda" and not _interpreting():
            raise UnsupportedError(f"kernel_mapping[{layer!r}] asks for the Triton kernel {name!r} on {device_type}; "
                                   "Triton kernels need a CUDA GPU. Map this device to '' for plain PyTorch, load "
                                   "the model on a GPU, or set TRITON_INTERPRET=1 (slow, for testing)")
        return name, "requested"
    if config is not None and not config.inherit_mapping:
        return "", "not in the mapping (inherit_mapping=False)"
    if device_type != "cuda":
        return "", f"default on {device_type}: Triton kernels need a GPU"
    if mode not in lt.default_modes:
        return "", f"default in {mode}: the plain layer is already optimal here"
    return lt.mode_defaults.get(mode, next(iter(lt.kernels))), "default on cuda"


def _module_device_type(module, fallback: str) -> str:
    for p in module.parameters(recurse=False):
        return p.device.type
    return fallback


def _apply(model, config: KernelConfig | None, mode: str) -> dict:
    """Binds the resolved kernels for ``mode``; returns {layer type: (kernel or "", reason, count)}."""
    from ..models import structure

    model_device = "cuda" if any(p.device.type == "cuda" for p in model.parameters()) else "cpu"
    chosen = {}
    for module in model.modules():
        for lt in LAYER_TYPES.values():
            if not lt.matches(module):
                continue
            name, why = resolve(lt.name, _module_device_type(module, model_device), mode, config)
            if lt.name == "ForCausalLMLoss":
                from .fused_linear_cross_entropy import fused_linear_cross_entropy

                module.fused_loss = fused_linear_cross_entropy if name else None
            else:
                old = module.__dict__.pop("forward", None)
                kernel = lt.kernels[name] if name else None
                if kernel is not None:
                    module.forward = bind(kernel, module)
                if getattr(old, "__func__", old) is not kernel:
                    structure.changed()  # captured graphs replay the forward bound before
            kernel, reason, count = chosen.get(lt.name, (name, why, 0))
            chosen[lt.name] = (kernel, reason, count + 1)
    return chosen


def _mode_hook(model, training: bool) -> None:
    if getattr(model, "_kernel_config", False) is not False:
        _record(model, _apply(model, model._kernel_config, "training" if training else "inference"))


def follow_device(model) -> None:
    """After a move: the kernels of a kernelized model chosen again for where it is now, as on a mode
    change (``use_kernels=True`` on a CPU load chose plain layers; moved to a GPU it gets its kernels)."""
    if _mode_hook in model.__dict__.get("_mode_hooks", ()):
        _mode_hook(model, model.training)


def _record(model, chosen: dict) -> None:
    parts = [f"{layer} -> {kernel or 'plain'} ({why}, {n}x)" for layer, (kernel, why, n) in chosen.items()]
    model._choices["kernels"] = "; ".join(parts) if parts else "no swappable layers"
    if chosen.get("DecoderLayer", ("",))[0]:
        from .fused_norm_decode import describe

        model._choices["decode layer"] = describe  # read when explained: the switches may change
    else:
        model._choices.pop("decode layer", None)
    for layer, (kernel, why, _) in chosen.items():
        logger.info("kernels: %s -> %s (%s)", layer, kernel or "plain PyTorch", why)


def kernelize(model, kernel_config: KernelConfig | None = None, use_kernels: bool = True):
    """Swaps kernels into ``model`` for its current mode (and again on every ``.train()``/``.eval()``).

    ``kernel_config=None`` uses the default mapping of the model's device; ``use_kernels=False`` puts
    every plain layer back and stops following mode changes. Returns the model.
    """
    hooks = model.__dict__.setdefault("_mode_hooks", [])
    if not use_kernels:
        _apply(model, KernelConfig(inherit_mapping=False), "inference")
        model._kernel_config = False
        if _mode_hook in hooks:
            hooks.remove(_mode_hook)
        model._choices.pop("kernels", None)
        model._choices.pop("decode layer", None)
        return model
    model._kernel_config = kernel_config
    if _mode_hook not in hooks:
        hooks.append(_mode_hook)
    _mode_hook(model, model.training)
    return model


# -- `cudaformers kernels [MODEL]` ----------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", help="a model folder or Hub id: show only its layer types")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="device type to resolve for (default: this machine's)")


def layer_types_of(model_id: str) -> list[str]:
    """The layer types a model has, from its config alone (the model is built on the meta device)."""
    import torch

    from ..config import AutoConfig
    from ..models.registry import model_class_for

    config = AutoConfig.from_pretrained(model_id)
    with torch.device("meta"):
        model = model_class_for(config)(config)
    return [lt.name for lt in LAYER_TYPES.values() if any(lt.matches(m) for m in model.modules())]


def run(args) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = layer_types_of(args.model) if args.model else list(LAYER_TYPES)
    rows = [("layer type", "inference", "training", "what")]
    for name in names:
        cells = []
        for mode in MODES:
            kernel, why = resolve(name, device, mode, None)
            cells.append(f"{kernel or 'plain'} ({why})")
        rows.append((name, *cells, LAYER_TYPES[name].about))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print(f"kernels for device {device} (use_kernels=True){' for ' + args.model if args.model else ''}:")
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0
