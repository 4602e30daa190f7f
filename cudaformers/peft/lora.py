"""LoRA adapters with the ``peft`` package's API and file format.

``get_peft_model(model, LoraConfig(...))`` wraps each targeted Linear as ``LoraLinear`` (``base_layer``
frozen, ``lora_A [r, in]`` and ``lora_B [out, r]`` trainable, output ``base(x) + B(A(dropout(x))) *
alpha / r``) and freezes everything else. ``save_pretrained`` writes adapter_config.json and
adapter_model.safetensors under peft's key names (``base_model.model.<module>.lora_A.weight``), so
adapters move between cudaformers and peft + transformers both ways. The base may be quantized
(QLoRA): gradients reach the adapters through the dequantizing matmul's backward.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, UnsupportedError

logger = logging.getLogger("cudaformers")
PREFIX = "base_model.model."
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
# peft options that change the math; loading an adapter that sets one is refused, not approximated.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "layers_to_transform": None,
                "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "target_parameters": None,
                "trainable_token_indices": None, "layer_replication": None, "exclude_modules": None}


@dataclass
class LoraConfig:
    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None
    bias: str = "none"  # "none" | "all" | "lora_only"
    task_type: str | None = None
    modules_to_save: list[str] | None = None
    use_rslora: bool = False
    init_lora_weights: bool | str = True  # True (B = 0), "gaussian", or False (random B: tests)
    base_model_name_or_path: str | None = None
    inference_mode: bool = False
    peft_type: str = field(default="LORA", init=False)

    def __post_init__(self):
        if self.r <= 0:
            raise UnsupportedError(f"LoraConfig(r={self.r}): the rank must be a positive integer")
        if self.bias not in ("none", "all", "lora_only"):
            raise UnsupportedError(f"LoraConfig(bias={self.bias!r}): use 'none', 'all' or 'lora_only'")
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_dict(self) -> dict:
        return {**asdict(self), **_UNSUPPORTED}

    @classmethod
    def from_dict(cls, data: dict) -> "LoraConfig":
        if data.get("peft_type", "LORA") != "LORA":
            raise UnsupportedError(f"adapter peft_type={data['peft_type']!r}: cudaformers loads LoRA adapters only")
        for key, neutral in _UNSUPPORTED.items():
            if data.get(key, neutral) not in (neutral, None, {}, False):
                raise UnsupportedError(f"the adapter sets {key}={data[key]!r}, which cudaformers does not implement; "
                                       "load it with peft, or merge it there and load the merged model")
        names = {"r", "lora_alpha", "lora_dropout", "target_modules", "bias", "task_type", "modules_to_save",
                 "use_rslora", "init_lora_weights", "base_model_name_or_path", "inference_mode"}
        return cls(**{k: v for k, v in data.items() if k in names})


class LoraLinear(nn.Module):
    """A frozen Linear (plain or quantized) plus a trainable low-rank update."""

    is_adapter_layer = True

    def __init__(self, base_layer: nn.Module, config: LoraConfig):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        # Adapters live in fp32 even on a bf16 or 4-bit base (as peft does): their updates are small.
        with torch.device(base_layer.weight.device):
            self.lora_A = nn.Linear(self.in_features, config.r, bias=False, dtype=torch.float32)
            self.lora_B = nn.Linear(config.r, self.out_features, bias=False, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.scaling = config.scaling
        self.merged = False
        self.disabled = False
        self.reset_lora(config.init_lora_weights)

    @property
    def weight(self):  # code that reads a Linear's size or device keeps working
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    @torch.no_grad()
    def reset_lora(self, init) -> None:
        if init == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1 / self.lora_A.out_features)
        else:
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        if init is False:
            nn.init.normal_(self.lora_B.weight, std=0.02)
        else:
            nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """``[out, in]``: what merging adds to the base weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.merged or self.disabled:
            return y
        a = self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))
        return y + (self.lora_B(a) * self.scaling).to(y.dtype)

    @torch.no_grad()
    def merged_base(self) -> nn.Module:
        """The base layer with the update folded in (a quantized base is re-quantized)."""
        base = self.base_layer
        if self.merged:
            return base
        if isinstance(base, nn.Linear):
            base.weight += self.delta_weight().to(base.weight.dtype)
        else:
            logger.warning("merging LoRA into a %s-quantized layer re-quantizes it: the merged weights carry a "
                           "new rounding error (merge into a bf16 copy of the base to avoid it)", base.method)
            base.quantize_(base.dequantize(torch.float32) + self.delta_weight().float())
        self.merged = True
        return base

    def extra_repr(self) -> str:
        return f"r={self.lora_A.out_features}, scaling={self.scaling:g}"


def _matches(name: str, targets) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _target_names(model: nn.Module, config: LoraConfig) -> list[str]:
    from ..quant.linear import QuantLinear

    linear = (nn.Linear, QuantLinear)
    targets = config.target_modules
    if targets is None:
        raise UnsupportedError("LoraConfig needs target_modules, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj'] "
                               "or 'all-linear'")
    names = [n for n, m in model.named_modules() if isinstance(m, linear) and n and
             (targets == "all-linear" and n.rpartition(".")[2] != "lm_head" or
              targets != "all-linear" and _matches(n, targets))]
    if not names:
        raise UnsupportedError(f"target_modules={targets!r} matches no Linear layer; names look like "
                               f"{[n for n, m in model.named_modules() if isinstance(m, linear)][:4]}")
    return names


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


class PeftModel(nn.Module):
    """A model with LoRA adapters; everything not defined here is the wrapped model's."""

    def __init__(self, model: nn.Module, config: LoraConfig):
        super().__init__()
        self.base_model = model
        self.peft_config = {"default": config}
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = getattr(model, "name_or_path", None)
        for p in model.parameters():
            p.requires_grad_(False)
        self.adapter_names = _target_names(model, config)
        for name in self.adapter_names:
            _set_module(model, name, LoraLinear(model.get_submodule(name), config))
        self.saved_module_names = []
        for key in config.modules_to_save or []:
            for name, module in list(model.named_modules()):
                if name and _matches(name, [key]) and name not in self.saved_module_names:
                    copy_ = copy.deepcopy(module)  # trained in full; the original is left untouched
                    _set_module(model, name, copy_)
                    self.saved_module_names.append(name)
        for n, p in model.named_parameters():
            is_bias = n.endswith(".bias")
            p.requires_grad_(".lora_A." in n or ".lora_B." in n or self._saved_module(n) is not None
                             or (is_bias and config.bias == "all")
                             or (is_bias and config.bias == "lora_only" and ".base_layer." in n))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.base_model.generate(*args, **kwargs)

    def get_base_model(self) -> nn.Module:
        return self.base_model

    def lora_layers(self) -> list[LoraLinear]:
        return [m for m in self.base_model.modules() if isinstance(m, LoraLinear)]

    def _saved_module(self, param_name: str) -> str | None:
        return next((m for m in self.saved_module_names if param_name.startswith(m + ".")), None)

    # -- trainable parameters ----------------------------------------------------------------------
    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return trainable, sum(p.numel() for p in self.parameters())

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}")

    @contextlib.contextmanager
    def disable_adapter(self):
        layers = self.lora_layers()
        for layer in layers:
            layer.disabled = True
        try:
            yield
        finally:
            for layer in layers:
                layer.disabled = False

    # -- merging -----------------------------------------------------------------------------------
    def merge_and_unload(self) -> nn.Module:
        """Fold every adapter into its base layer and return the plain model."""
        for name, module in list(self.base_model.named_modules()):
            if isinstance(module, LoraLinear):
                _set_module(self.base_model, name, module.merged_base())
        return self.base_model

    def unload(self) -> nn.Module:
        """Remove the adapters without merging them."""
        for name, module in list(self.base_model.named_modules()):
            if isinstance(module, LoraLinear):
                _set_module(self.base_model, name, module.base_layer)
        return self.base_model

    # -- peft file format --------------------------------------------------------------------------
    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        config = self.peft_config["default"]
        out = {}
        for n, p in self.base_model.named_parameters():
            keep = (".lora_A." in n or ".lora_B." in n or self._saved_module(n) is not None
                    or (n.endswith(".bias") and (config.bias == "all" or
                                                 config.bias == "lora_only" and ".base_layer." in n)))
            if keep:
                out[PREFIX + n] = p.detach()
        return out

    def save_pretrained(self, folder, **_ignored) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = dict(self.peft_config["default"].to_dict(), inference_mode=True)
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.to("cpu").contiguous() for k, v in self.adapter_state_dict().items()}
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, model: nn.Module, model_id, is_trainable: bool = False, **_ignored) -> "PeftModel":
        """Attach the adapter saved in ``model_id`` (a folder, by cudaformers or peft) to ``model``."""
        from safetensors.torch import load_file

        from ..hub import resolve_folder

        folder = resolve_folder(model_id, weights=False)
        config_file = folder / CONFIG_NAME
        if not config_file.is_file():
            raise CheckpointError(f"{folder} has no {CONFIG_NAME}; it is not a PEFT adapter folder")
        config = LoraConfig.from_dict(json.loads(config_file.read_text()))
        config.inference_mode = not is_trainable
        config.init_lora_weights = True
        peft_model = cls(model, config)
        if not (folder / WEIGHTS_NAME).is_file():
            raise CheckpointError(f"{folder} has no {WEIGHTS_NAME} (a .bin adapter is a pickle, which cudaformers "
                                  "does not load; re-save it with safetensors)")
        peft_model.load_adapter_weights(load_file(str(folder / WEIGHTS_NAME)))
        if not is_trainable:
            for p in peft_model.parameters():
                p.requires_grad_(False)
            peft_model.eval()
        return peft_model

    @torch.no_grad()
    def load_adapter_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.base_model.named_parameters())
        expected = set(self.adapter_state_dict())
        for key, tensor in tensors.items():
            name = key.removeprefix(PREFIX).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            if name not in params:
                raise CheckpointError(f"adapter tensor {key!r} has no place in this model (wrong base model or "
                                      "target_modules)")
            if params[name].shape != tensor.shape:
                raise CheckpointError(f"adapter tensor {key!r} is {tuple(tensor.shape)}, the model expects "
                                      f"{tuple(params[name].shape)}; the adapter was trained on another base model")
            params[name].copy_(tensor)
            expected.discard(PREFIX + name)
        if expected:
            raise CheckpointError(f"the adapter file lacks {len(expected)} tensors, e.g. {sorted(expected)[:3]}")


def get_peft_model(model: nn.Module, peft_config: LoraConfig, adapter_name: str = "default", **_ignored) -> PeftModel:
    if adapter_name != "default":
        raise UnsupportedError("one adapter per model: adapter_name must be 'default'")
    if isinstance(model, PeftModel):
        raise UnsupportedError("this model already has LoRA adapters; merge_and_unload() it first")
    return PeftModel(model, peft_config)
