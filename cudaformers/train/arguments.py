"""TrainingArguments: the knobs of a training run, named as in transformers.

Arguments are checked when built: an unknown name, a contradiction (bf16 and fp16, warmup_steps and
warmup_ratio, fsdp and deepspeed) or a request this machine cannot honour (bf16 on a GPU without
bf16) raises an error that says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UnsupportedError

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
STRATEGIES = ("no", "steps", "epoch")
FSDP_OPTIONS = ("full_shard", "shard_grad_op", "hybrid_shard", "offload", "auto_wrap")
REPORTERS = ("none", "all", "tensorboard")


@dataclass(repr=False)
class TrainingArguments:
    output_dir: str = "trainer_output"
    # -- batch and schedule -----------------------------------------------------------------------
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # -- optimizer --------------------------------------------------------------------------------
    optim: str = "adamw_torch_fused"
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0  # an int counts steps; a float in (0, 1) is a share of the total steps
    warmup_ratio: float | None = None
    # -- logging, evaluation, checkpoints ---------------------------------------------------------
    logging_steps: float = 10
    logging_dir: str | None = None
    report_to: str | list[str] = "none"
    disable_tqdm: bool = False
    eval_strategy: str = "no"
    eval_steps: float | None = None
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    # -- numerics ---------------------------------------------------------------------------------
    seed: int = 42
    bf16: bool = False
    fp16: bool = False
    tf32: bool | None = None
    gradient_checkpointing: bool = False
    # -- data -------------------------------------------------------------------------------------
    packing: bool = False
    max_seq_length: int | None = None
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    # -- devices and distribution -----------------------------------------------------------------
    use_cpu: bool = False
    fsdp: str | list[str] = ""
    tp_size: int = 1
    deepspeed: str | dict | None = None
    ddp_find_unused_parameters: bool | None = None
    ddp_timeout: int = 1800

    def __post_init__(self):
        self.output_dir = os.fspath(self.output_dir)
        self._check_ranges()
        self._check_choices()
        self._check_contradictions()
        self._check_device()

    # -- checks -----------------------------------------------------------------------------------
    def _check_ranges(self):
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps", "tp_size"):
            if int(getattr(self, name)) < 1 or int(getattr(self, name)) != getattr(self, name):
                raise UnsupportedError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise UnsupportedError("nothing to train: set max_steps > 0 or num_train_epochs > 0")
        for name in ("logging_steps", "save_steps"):
            if getattr(self, name) <= 0:
                raise UnsupportedError(f"{name} must be > 0 (an int, or a float in (0, 1) for a share of the run)")
        if self.learning_rate < 0 or self.weight_decay < 0 or self.adam_epsilon <= 0:
            raise UnsupportedError("learning_rate and weight_decay must be >= 0 and adam_epsilon > 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise UnsupportedError(f"adam_beta1={self.adam_beta1}, adam_beta2={self.adam_beta2}: both must be in [0, 1)")
        w = self.warmup_steps
        if w < 0 or (w >= 1 and w != int(w)):
            raise UnsupportedError(f"warmup_steps={w!r}: use an int (steps) or a float in (0, 1) (share of the run)")
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio < 1:
            raise UnsupportedError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UnsupportedError("save_total_limit must be >= 1 (or None to keep every checkpoint)")
        if self.max_seq_length is not None and self.max_seq_length < 2:
            raise UnsupportedError("max_seq_length must be >= 2 (a token and its next token)")

    def _check_choices(self):
        _choose("lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS)
        _choose("optim", self.optim, OPTIMIZERS)
        _choose("eval_strategy", self.eval_strategy, STRATEGIES)
        _choose("save_strategy", self.save_strategy, STRATEGIES)
        for r in self.report_to_list:
            _choose("report_to", r, REPORTERS)
        for opt in self.fsdp_options:
            _choose("fsdp", opt, FSDP_OPTIONS)
        if isinstance(self.deepspeed, str) and not Path(self.deepspeed).is_file():
            raise UnsupportedError(f"deepspeed={self.deepspeed!r} is not a file; pass a DeepSpeed JSON config path or a dict")

    def _check_contradictions(self):
        if self.bf16 and self.fp16:
            raise UnsupportedError("bf16=True and fp16=True contradict each other; pick one")
        if self.warmup_ratio and self.warmup_steps:
            raise UnsupportedError("both warmup_steps and warmup_ratio are set; keep one")
        if self.fsdp_options and self.deepspeed is not None:
            raise UnsupportedError("fsdp and deepspeed are two ways to shard the same thing; pick one")
        if self.tp_size > 1 and self.deepspeed is not None:
            raise UnsupportedError("tp_size > 1 does not combine with deepspeed here; use tp_size with fsdp instead")
        if self.fsdp_options and set(self.fsdp_options) >= {"full_shard", "shard_grad_op"}:
            raise UnsupportedError("fsdp: 'full_shard' and 'shard_grad_op' contradict each other; pick one")
        if self.eval_strategy == "steps" and self.eval_steps is not None and self.eval_steps <= 0:
            raise UnsupportedError("eval_steps must be > 0")
        if self.fp16 and self.deepspeed is None and self.fsdp_options and "offload" in self.fsdp_options:
            raise UnsupportedError("fp16 with FSDP CPU offload is not supported; use bf16=True")

    def _check_device(self):
        dev = self.device
        if dev.type == "cuda":
            if self.bf16 and not torch.cuda.is_bf16_supported(including_emulation=False):
                name = torch.cuda.get_device_name(dev)
                raise UnsupportedError(f"bf16=True but {name} has no bfloat16 support; use fp16=True "
                                       "(mixed precision with a gradient scaler) instead")
        elif self.fp16:
            raise UnsupportedError("fp16=True needs a CUDA GPU (its gradient scaler is for GPU fp16); "
                                   "on the CPU use bf16=True or full precision")
        if self.tf32 and dev.type != "cuda":
            raise UnsupportedError("tf32=True needs an NVIDIA GPU (Ampere or newer); drop it on the CPU")

    # -- derived ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` when a GPU is visible (and use_cpu is False), else the CPU."""
        from ..distributed.init import local_device

        return local_device(use_cpu=self.use_cpu)

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def fsdp_options(self) -> list[str]:
        opts = self.fsdp.split() if isinstance(self.fsdp, str) else list(self.fsdp or [])
        return [o for o in opts if o]

    @property
    def report_to_list(self) -> list[str]:
        r = self.report_to
        items = [r] if isinstance(r, str) else list(r or ["none"])
        return [x for x in items if x] or ["none"]

    @property
    def strategy(self) -> str:
        """How the model is spread: 'single', 'ddp', 'fsdp', 'tp', 'fsdp+tp' or 'deepspeed'."""
        if self.deepspeed is not None:
            return "deepspeed"
        if self.tp_size > 1:
            return "fsdp+tp" if self.fsdp_options else "tp"
        if self.fsdp_options:
            return "fsdp"
        return "ddp" if self.world_size > 1 else "single"

    @property
    def deepspeed_config(self) -> dict | None:
        if self.deepspeed is None or isinstance(self.deepspeed, dict):
            return self.deepspeed
        return json.loads(Path(self.deepspeed).read_text())

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def __repr__(self) -> str:
        return f"TrainingArguments({self.to_json_string()})"


def _choose(name: str, value, choices) -> None:
    if value not in choices:
        raise UnsupportedError(f"{name}={value!r} is not supported; choose one of {list(choices)}")


_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}
_dataclass_init = TrainingArguments.__init__


def _init(self, *args, **kwargs):
    # A misspelt or unsupported argument must not vanish into a default: name it and the nearest one.
    unknown = sorted(set(kwargs) - _FIELDS)
    if unknown:
        hints = [f"{u!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, _FIELDS, 1)) else "")
                 for u in unknown]
        raise UnsupportedError(f"TrainingArguments got unknown argument(s) {', '.join(hints)}; "
                               f"supported: {sorted(_FIELDS)}")
    _dataclass_init(self, *args, **kwargs)


_init.__doc__ = _dataclass_init.__doc__
_init.__signature__ = __import__("inspect").signature(_dataclass_init)
TrainingArguments.__init__ = _init
