"""Quantization configs, with transformers' names where transformers has them.

``BitsAndBytesConfig`` takes transformers' arguments (``load_in_4bit``, ``bnb_4bit_quant_type``,
``bnb_4bit_use_double_quant``, ``bnb_4bit_compute_dtype``, ``load_in_8bit``) but runs on
cudaformers' own Triton kernels: no bitsandbytes. ``Int8Config``, ``Int4Config`` and ``FP8Config``
are weight-only int8 (per channel), group-wise int4 and e4m3 fp8. A config saved in config.json
(``to_dict``) comes back through ``quantization_config_from``; GPTQ and AWQ checkpoints' configs load too.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")
DEFAULT_SKIP = ("lm_head",)
# The layout of packed int8/int4/NF4/FP4 tensors in saved checkpoints (kernels/quant_matmul.py). A
# checkpoint saved quantized without it predates that layout and cannot be read as it.
PACKING = "planes"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedError(f"compute dtype {value!r} is not supported; use 'bfloat16', 'float16' or 'float32'")
    return _DTYPES[name]


@dataclass
class QuantizationConfig:
    quant_method = ""
    modules_to_not_convert: list[str] | None = None
    # The layout packed tensors of a checkpoint are in; None: a saved config without the key (older layout).
    packing: str | None = PACKING

    @property
    def method(self) -> str:
        """The kernel family: int8, int4, nf4, fp4, fp8."""
        raise NotImplementedError

    @property
    def skip_modules(self) -> tuple[str, ...]:
        return tuple(self.modules_to_not_convert) if self.modules_to_not_convert is not None else DEFAULT_SKIP

    def to_dict(self) -> dict:
        out = {"quant_method": self.quant_method}
        for k, v in asdict(self).items():
            out[k] = str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
        out["packing"] = PACKING
        return out

    def saved(self) -> "QuantizationConfig":
        """The config a model quantized with this one records, so that ``save_pretrained`` writes what its
        tensors are (an imported GPTQ/AWQ checkpoint is repacked to int4 as it loads)."""
        return self

    def to_json_string(self) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2)

    def describe(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.describe()


@dataclass(repr=False)
class Int8Config(QuantizationConfig):
    """int8 weights, one fp32 scale per output channel; activations stay in the compute dtype."""

    quant_method = "int8"
    compute_dtype: torch.dtype | str | None = None

    method = property(lambda self: "int8")

    def describe(self) -> str:
        return "int8 weight-only, per-channel scales"


@dataclass(repr=False)
class Int4Config(QuantizationConfig):
    """int4 weights in groups of ``group_size`` input features, one fp16 scale (and zero point when
    ``sym=False``) per group. ``act_order``: each layer's input features are stored in its own order
    (``input_order``), as GPTQ's act-order checkpoints group them; set by those and by what is saved
    from them, not for quantizing float weights."""

    quant_method = "int4"
    group_size: int = 128
    sym: bool = True
    compute_dtype: torch.dtype | str | None = None
    act_order: bool = False

    method = property(lambda self: "int4")

    def __post_init__(self):
        if self.group_size < 16 or self.group_size & (self.group_size - 1):
            raise UnsupportedError(f"Int4Config(group_size={self.group_size}): use a power of two >= 16 "
                                   "(128 is the usual choice)")

    label = "int4 weight-only"  # what describe() calls it

    def describe(self) -> str:
        order = ", act-order" if self.act_order else ""
        return f"{self.label}, group {self.group_size}, {'symmetric' if self.sym else 'asymmetric'}{order}"


@dataclass(repr=False)
class _ImportedInt4(Int4Config):
    """A pre-quantized 4-bit checkpoint (read from its config.json), repacked to int4 as it loads:
    what GPTQ and AWQ share."""

    format_name = ""
    bits: int = 4

    def __post_init__(self):
        if self.group_size == -1:
            raise UnsupportedError(f"{self.format_name} group_size=-1 (one group per row) is not supported; use a "
                                   "grouped checkpoint (group_size 32/64/128)")
        super().__post_init__()
        if self.bits != 4:
            raise UnsupportedError(f"{self.format_name} bits={self.bits}: only 4-bit {self.format_name} checkpoints "
                                   "load")

    @property
    def skip_modules(self) -> tuple[str, ...]:
        return _imported_skip(self)

    def saved(self) -> Int4Config:
        return Int4Config(modules_to_not_convert=list(self.skip_modules), group_size=self.group_size, sym=self.sym,
                          compute_dtype=self.compute_dtype, act_order=self.act_order)


@dataclass(repr=False)
class GPTQConfig(_ImportedInt4):
    """A pre-quantized GPTQ checkpoint; repacked to int4 as it loads."""

    quant_method, format_name, label = "gptq", "GPTQ", "GPTQ int4 checkpoint"
    desc_act: bool = False
    checkpoint_format: str = "gptq"

    def __post_init__(self):
        super().__post_init__()
        self.act_order = bool(self.desc_act)  # features in g_idx's groups, not in order
        if self.checkpoint_format not in ("gptq", "gptq_v2"):
            raise UnsupportedError(f"GPTQ checkpoint_format={self.checkpoint_format!r} is not supported; 'gptq' and "
                                   "'gptq_v2' checkpoints load")


@dataclass(repr=False)
class AwqConfig(_ImportedInt4):
    """A pre-quantized AWQ checkpoint (AutoAWQ's "gemm" layout); repacked to int4 as it loads. AWQ
    stores a zero point per group, so it loads as asymmetric int4."""

    quant_method, format_name, label = "awq", "AWQ", "AWQ int4 checkpoint"
    zero_point: bool = True
    version: str = "gemm"
    sym: bool = False

    def __post_init__(self):
        super().__post_init__()
        if str(self.version).lower() != "gemm":
            raise UnsupportedError(f"AWQ version={self.version!r}: only the 'gemm' layout (AutoAWQ's default, packed "
                                   "along the output features) loads; use a 'gemm' checkpoint or the bf16 original "
                                   "with Int4Config()")
        if not self.zero_point:
            raise UnsupportedError("AWQ zero_point=False checkpoints are not supported; use one quantized with "
                                   "zero_point=True (AutoAWQ's default)")
        self.sym = False


def _imported_skip(config: QuantizationConfig) -> tuple[str, ...]:
    """A pre-quantized checkpoint keeps its lm_head in float whatever else its config lists (transformers
    reads GPTQ and AWQ checkpoints so too)."""
    listed = tuple(config.modules_to_not_convert or ())
    return DEFAULT_SKIP + tuple(m for m in listed if m not in DEFAULT_SKIP)


@dataclass(repr=False)
class FP8Config(QuantizationConfig):
    """e4m3 weights with per-channel scales; activations quantized per token at run time; matmuls on
    fp8 tensor cores (compute capability 8.9+).

    ``weight_block_size`` (read from a block-scaled fp8 checkpoint's config.json, e.g. ``[128, 128]``):
    the files hold e4m3 weights with one multiplier a block (``quant/fp8_blocks.py``); they are
    quantized again per channel as they load, or with ``dequantize=True`` kept in the model's dtype,
    which runs on any device."""

    quant_method = "fp8"
    activation_scheme: str = "dynamic"
    weight_block_size: list[int] | None = None
    dequantize: bool = False

    method = property(lambda self: "fp8")

    def __post_init__(self):
        if self.activation_scheme != "dynamic":
            raise UnsupportedError(f"FP8Config(activation_scheme={self.activation_scheme!r}): only 'dynamic' "
                                   "(per-token scales computed at run time) is supported")
        if self.weight_block_size is not None:
            block = list(self.weight_block_size)
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise UnsupportedError(f"FP8Config(weight_block_size={self.weight_block_size!r}): give two positive "
                                       "ints, rows and columns of a block (e.g. [128, 128])")
            self.weight_block_size = block

    @property
    def skip_modules(self) -> tuple[str, ...]:
        return _imported_skip(self) if self.weight_block_size else super().skip_modules

    def saved(self) -> "FP8Config":
        # Re-quantized per channel as the blocks load: what the model holds (dequantize=True holds floats
        # and records no quantization at all).
        return FP8Config(modules_to_not_convert=self.modules_to_not_convert) if self.weight_block_size else self

    def describe(self) -> str:
        read = f", read from fp8 blocks of {self.weight_block_size[0]} x {self.weight_block_size[1]}" \
            if self.weight_block_size else ""
        return f"fp8 e4m3 weights (per-channel) and activations (per-token), torch._scaled_mm{read}"


def fp8_block_size(stored) -> list[int] | None:
    """The ``weight_block_size`` of a block-scaled fp8 checkpoint, from its config.json's
    ``quantization_config`` (``stored``: a dict, a config or None); None for any other checkpoint."""
    if stored is None:
        return None
    stored = stored if isinstance(stored, dict) else stored.to_dict()
    if getattr(stored.get("quant_method"), "value", stored.get("quant_method")) != "fp8":
        return None
    return list(stored["weight_block_size"]) if stored.get("weight_block_size") else None


def with_checkpoint_blocks(config: QuantizationConfig, stored) -> QuantizationConfig:
    """A user's ``FP8Config`` for a block-scaled fp8 checkpoint (``stored``: its config.json's
    ``quantization_config``) takes the checkpoint's block size: the files say how they are laid out."""
    block = fp8_block_size(stored)
    if isinstance(config, FP8Config) and config.weight_block_size is None and block:
        return replace(config, weight_block_size=block)
    return config


@dataclass(repr=False)
class BitsAndBytesConfig(QuantizationConfig):
    """transformers' ``BitsAndBytesConfig`` arguments, on cudaformers' kernels."""

    quant_method = "bitsandbytes"
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"  # transformers' default
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: torch.dtype | str | None = None
    llm_int8_skip_modules: list[str] | None = None
    llm_int8_threshold: float = 6.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.load_in_8bit == self.load_in_4bit:
            raise UnsupportedError("BitsAndBytesConfig needs exactly one of load_in_4bit=True or load_in_8bit=True")
        if self.bnb_4bit_quant_type not in ("nf4", "fp4"):
            raise UnsupportedError(f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}: use 'nf4' or 'fp4'")
        self.bnb_4bit_compute_dtype = _dtype(self.bnb_4bit_compute_dtype)
        if self.modules_to_not_convert is None and self.llm_int8_skip_modules is not None:
            self.modules_to_not_convert = list(self.llm_int8_skip_modules)
        if self.load_in_8bit:
            logger.info("load_in_8bit: int8 weight-only with per-channel scales (no LLM.int8 outlier "
                        "decomposition; llm_int8_threshold is not used)")

    @property
    def method(self) -> str:
        return "int8" if self.load_in_8bit else self.bnb_4bit_quant_type

    @property
    def compute_dtype(self):
        return self.bnb_4bit_compute_dtype

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("extra")
        out.update(self.extra)
        return out

    def describe(self) -> str:
        if self.load_in_8bit:
            return "bitsandbytes-style 8-bit: int8 weight-only, per-channel scales"
        dq = ", double quant" if self.bnb_4bit_use_double_quant else ""
        return f"bitsandbytes-style 4-bit: {self.bnb_4bit_quant_type} in blocks of 64{dq}"


_BY_METHOD = {c.quant_method: c for c in (Int8Config, Int4Config, GPTQConfig, AwqConfig, FP8Config,
                                           BitsAndBytesConfig)}


def quantization_config_from(value) -> QuantizationConfig:
    """A config object, a dict (config.json's ``quantization_config``) or transformers' config object."""
    if isinstance(value, QuantizationConfig):
        return value
    if not isinstance(value, dict) and hasattr(value, "to_dict"):
        value = value.to_dict()  # e.g. transformers.BitsAndBytesConfig
    if not isinstance(value, dict):
        raise UnsupportedError(f"quantization_config={value!r}: pass BitsAndBytesConfig, Int8Config, Int4Config, "
                               "FP8Config or a dict with a 'quant_method'")
    data = dict(value)
    method = data.pop("quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    cls = _BY_METHOD.get(method)
    if cls is None:
        raise UnsupportedError(f"quant_method={method!r} is not supported; cudaformers loads {sorted(_BY_METHOD)}")
    if method == "fp8" and str(data.get("fmt", "e4m3")).lower() != "e4m3":
        raise UnsupportedError(f"fp8 checkpoints in {data['fmt']!r}: only e4m3 weights load")
    if method == "gptq":
        data["checkpoint_format"] = data.get("checkpoint_format") or "gptq"
    known = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in known}
    kwargs.setdefault("packing", None)
    if cls is BitsAndBytesConfig:
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known}  # kept for round trips
    elif method in ("int8", "int4", "gptq", "awq") and kwargs.get("compute_dtype"):
        kwargs["compute_dtype"] = _dtype(kwargs["compute_dtype"])
    return cls(**kwargs)
