"""DeepSpeed ZeRO stages 1-3, when the ``deepspeed`` package is installed.

The Trainer builds its optimizer and schedule as usual and hands them to ``deepspeed.initialize``;
"auto" entries of the user's config are filled from TrainingArguments, and explicit entries that
contradict them raise. FSDP2 (``fsdp="full_shard"``) gives ZeRO-3 with nothing to install.
"""

from __future__ import annotations

import copy
import logging

from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")


def require_deepspeed():
    try:
        import deepspeed
    except ImportError as e:
        raise UnsupportedError("deepspeed=... needs the deepspeed package (`pip install deepspeed`); or use "
                               "fsdp='full_shard' (FSDP2, part of torch), which shards like ZeRO-3") from e
    return deepspeed


def fill_config(config: dict, args, world_size: int) -> dict:
    """The user's config with "auto" values (and absent batch/precision keys) taken from ``args``."""
    cfg = copy.deepcopy(config)
    wanted = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size,
    }
    for key, value in wanted.items():
        have = cfg.get(key, "auto")
        if have == "auto":
            cfg[key] = value
        elif have != value:
            raise UnsupportedError(f"deepspeed config sets {key}={have} but TrainingArguments implies {value}; "
                                   f'set it to "auto" or make them agree')
    for key, on in (("bf16", args.bf16), ("fp16", args.fp16)):
        section = cfg.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = on
        elif section["enabled"] != on:
            raise UnsupportedError(f"deepspeed config sets {key}.enabled={section['enabled']} but "
                                   f"TrainingArguments has {key}={on}; make them agree")
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UnsupportedError(f"deepspeed zero_optimization.stage={stage}; use 0, 1, 2 or 3")
    if "optimizer" in cfg or "scheduler" in cfg:
        raise UnsupportedError("the deepspeed config defines an optimizer/scheduler; remove them and set "
                               "optim/learning_rate/lr_scheduler_type in TrainingArguments instead")
    return cfg


class DeepSpeedRunner:
    """The engine behind the Trainer's forward/backward/step when ``deepspeed`` is set."""

    def __init__(self, model, optimizer, scheduler, args, world_size: int):
        ds = require_deepspeed()
        cfg = fill_config(args.deepspeed_config, args, world_size)
        self.engine, self.optimizer, _, self.scheduler = ds.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
        self.stage = cfg.get("zero_optimization", {}).get("stage", 0)
        logger.info("DeepSpeed ZeRO stage %d over %d processes", self.stage, world_size)

    def micro_step(self, loss, *, last: bool, accumulation_steps: int) -> None:
        """Backward one micro-batch; the optimizer steps when ``last`` closes the accumulation window."""
        # Our windows can be short at an epoch's end: say where they close instead of letting the
        # engine count. The engine divides each loss by gradient_accumulation_steps; ours are
        # already normalised by the window's tokens, so undo that.
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * accumulation_steps)
        self.engine.step()

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save(self, folder) -> None:
        self.engine.save_checkpoint(str(folder), tag="deepspeed")

    def load(self, folder) -> None:
        self.engine.load_checkpoint(str(folder), tag="deepspeed", load_optimizer_states=True,
                                    load_lr_scheduler_states=True)

    def full_state_dict(self) -> dict:
        if self.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict() or {}
        return self.engine.module.state_dict()
