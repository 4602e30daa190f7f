"""Trainer: the training loop, for one process or one per GPU under torchrun.

Each optimizer step takes ``gradient_accumulation_steps`` micro-batches. Their losses are weighted by
the number of tokens that carry a loss, across micro-batches and processes, so accumulating k
micro-batches (or spreading them over k GPUs) gives the gradient of the one large batch.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
import signal
import threading
import time
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..attention.metadata import AttentionBatch
from ..distributed import ddp as ddp_mod
from ..distributed import fsdp as fsdp_mod
from ..distributed.blocks import enable_gradient_checkpointing, unique_parameter_count
from ..distributed.init import build_mesh, init_distributed
from ..errors import UnsupportedError
from . import checkpoint as ckpt
from .arguments import TrainingArguments
from .data import (ExampleDataset, PackedCollator, PackedDataset, PadCollator, ShardedSampler, count_input_tokens,
                   count_label_tokens)
from .logging import TrainLogger, peak_flops
from .optim import build_optimizer, clip_grad_norm
from .schedule import build_scheduler, resolve_warmup

logger = logging.getLogger("cudaformers")


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


class NonFiniteLossError(RuntimeError):
    pass


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def _loss_of(out) -> torch.Tensor:
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)):
        loss = out[0]
    if loss is None:
        raise UnsupportedError("the model returned no loss; it must accept labels= and return .loss")
    return loss


class Trainer:
    def __init__(self, model: nn.Module, args: TrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, tokenizer=None,
                 optimizers=(None, None)):
        self.args = args = args or TrainingArguments()
        self.dist = init_distributed(use_cpu=args.use_cpu, timeout_s=args.ddp_timeout)
        self.device = self.dist.device
        if args.tf32 is not None and self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        set_seed(args.seed)
        self.tokenizer = processing_class if processing_class is not None else tokenizer
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator = data_collator
        if args.eval_strategy != "no" and eval_dataset is None:
            raise UnsupportedError(f"eval_strategy={args.eval_strategy!r} needs an eval_dataset")
        self.model = model
        self.flat = args.packing
        # A wrapper (LoRA) passes its arguments through: the wrapped model's signature is what counts.
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(inner.forward).parameters
        if self.flat and not {"batch", "positions"} <= set(params):
            raise UnsupportedError(f"packing=True needs a model whose forward takes (input_ids, positions, batch, "
                                   f"labels) — cudaformers models do; {type(model).__name__} does not")
        # Models that take num_items_in_batch (cudaformers', transformers') return sum / num_items:
        # exact token weighting with no 0/0 on a micro-batch without targets. Others return a mean.
        self._takes_num_items = "num_items_in_batch" in params
        self.strategy = args.strategy
        self.dp_size = self.dist.world_size // args.tp_size
        self._optimizers = optimizers
        self._setup_precision()
        self._ds = None
        self.wrapped = self._prepare_model()
        self.global_step = 0
        self.log_history: list[dict] = []
        self._stop_signal = False
        # A CPU channel for control messages (stop on SIGTERM) that never waits for the GPU.
        self._control = dist.new_group(backend="gloo") if self.dist.is_distributed and dist.get_backend() != "gloo" \
            else None

    # -- setup ------------------------------------------------------------------------------------
    def _setup_precision(self):
        args = self.args
        dtypes = {p.dtype for p in self.model.parameters()}
        self.autocast_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        if args.fp16 and dtypes & {torch.bfloat16, torch.float16}:
            raise UnsupportedError("fp16=True needs float32 master weights; load the model in float32 "
                                   "(dtype=torch.float32) or use bf16")
        if args.fp16 and self.strategy in ("fsdp", "tp", "fsdp+tp"):
            raise UnsupportedError(f"fp16 with {self.strategy} is not supported; use bf16=True")
        if dtypes == {torch.bfloat16} and not args.fp16:
            logger.info("the model's parameters are bfloat16: training in pure bf16 (weights and optimizer "
                        "state in bf16); load it in float32 and pass bf16=True for fp32 master weights")
        self.scaler = torch.amp.GradScaler(self.device.type) if args.fp16 and self.strategy != "deepspeed" else None

    def _prepare_model(self) -> nn.Module:
        args, model = self.args, self.model
        model.to(self.device)
        if args.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        s = self.strategy
        if s == "single":
            return model
        if s == "ddp":
            return ddp_mod.wrap_ddp(model, self.device, find_unused_parameters=args.ddp_find_unused_parameters)
        if s == "deepspeed":
            return model  # wrapped by the engine once the optimizer exists (train())
        if s in ("tp", "fsdp+tp"):
            from ..distributed.tp import apply_tp

            mesh = build_mesh(self.dist, args.tp_size)
            apply_tp(model, mesh["tp"])
            self._tp_mesh = mesh
            if s == "tp":
                if self.dp_size > 1:
                    raise UnsupportedError(f"tp_size={args.tp_size} < {self.dist.world_size} processes: the rest "
                                           "must be data parallel; add fsdp='full_shard' (2-D FSDP x TP)")
                return model
            dp_mesh = mesh["dp"]
        else:
            dp_mesh = fsdp_mod.fsdp_mesh(self.device, args.fsdp_options, self.dist.world_size)
        fsdp_mod.apply_fsdp(model, dp_mesh, options=args.fsdp_options, param_dtype=self.autocast_dtype)
        return model

    def _loader(self, dataset, batch_size: int, shuffle: bool) -> tuple[torch.utils.data.DataLoader, ShardedSampler]:
        args = self.args
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise UnsupportedError("iterable datasets are not supported; pass a map-style dataset (a list, a "
                                   "torch Dataset or a datasets.Dataset)")
        examples = ExampleDataset(dataset, self.tokenizer, None if args.packing else args.max_seq_length)
        if args.packing:
            block = args.max_seq_length or 2048
            if args.max_seq_length is None:
                logger.info("packing: max_seq_length not set, packing rows of 2048 tokens")
            data, collate = PackedDataset(examples, block), PackedCollator()
        else:
            pad = getattr(self.tokenizer, "pad_token_id", None)
            pad = pad if pad is not None else getattr(self.tokenizer, "eos_token_id", None) or 0
            data, collate = examples, PadCollator(pad)
        if self.data_collator is not None:
            if args.packing:
                raise UnsupportedError("packing=True builds its own flat batches; drop data_collator or packing")
            data, collate = dataset, self.data_collator
        dp_rank = self.dist.rank // args.tp_size  # every process of a tp group reads the same data
        sampler = ShardedSampler(len(data), rank=dp_rank, world_size=self.dp_size, shuffle=shuffle,
                                 seed=args.seed, drop_last=args.dataloader_drop_last and shuffle)
        loader = torch.utils.data.DataLoader(
            data, batch_size=batch_size, sampler=sampler, collate_fn=collate,
            num_workers=args.dataloader_num_workers, pin_memory=self.device.type == "cuda",
            drop_last=args.dataloader_drop_last and shuffle,
            # Its own generator: building an iterator must not draw from the global RNG, or a resumed
            # run's dropout masks would differ from the uninterrupted run's.
            generator=torch.Generator().manual_seed(args.seed))
        return loader, sampler

    # -- one micro-batch --------------------------------------------------------------------------
    def _forward(self, model: nn.Module, batch: dict, num_items: torch.Tensor | None = None) -> torch.Tensor:
        """The micro-batch's loss: its mean, or its sum / ``num_items`` when that is given and the
        model takes it."""
        dev = self.device
        if self.flat:
            attn = AttentionBatch.from_seqlens(batch["seqlens"], dev)
            kwargs = {k: batch[k].to(dev, non_blocking=True) for k in ("input_ids", "positions", "labels")}
            kwargs["batch"] = attn
        else:
            kwargs = {k: v.to(dev, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if num_items is not None:
            kwargs["num_items_in_batch"] = num_items
        ctx = torch.autocast(dev.type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext()
        with ctx:
            return _loss_of(model(**kwargs)).float()

    def _window_counts(self, window: list[dict]) -> torch.Tensor:
        """[label tokens, input tokens] of the whole accumulation window, summed over data-parallel ranks."""
        counts = torch.tensor([[count_label_tokens(b), count_input_tokens(b)] for b in window], dtype=torch.float64)
        total = counts.sum(0).to(self.device)
        if self.dp_size > 1:
            dist.all_reduce(total, group=self._dp_group())
        return counts, total

    # -- the loop ---------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None) -> TrainOutput:
        args = self.args
        if self.train_dataset is None:
            raise UnsupportedError("Trainer.train() needs a train_dataset")
        loader, sampler = self._loader(self.train_dataset, args.per_device_train_batch_size, shuffle=True)
        bs, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
        micro_per_epoch = (sampler.samples_per_epoch // bs if loader.drop_last
                           else math.ceil(sampler.samples_per_epoch / bs))
        if micro_per_epoch == 0:
            raise UnsupportedError(f"the train dataset gives this process {sampler.samples_per_epoch} samples, fewer "
                                   f"than one batch of {bs}; lower per_device_train_batch_size")
        steps_per_epoch = math.ceil(micro_per_epoch / ga)
        total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        self.total_steps = total
        every = {k: self._interval(getattr(args, k), total) for k in ("logging_steps", "save_steps")}
        eval_every = self._interval(args.eval_steps or args.logging_steps, total)

        optimizer = self._optimizers[0] or build_optimizer(self.model, args)
        warmup = resolve_warmup(args.warmup_steps, args.warmup_ratio, total)
        scheduler = self._optimizers[1] or build_scheduler(optimizer, args.lr_scheduler_type, warmup, total)
        if self.strategy == "deepspeed":
            from ..distributed.deepspeed import DeepSpeedRunner

            self._ds = DeepSpeedRunner(self.model, optimizer, scheduler, args, self.dist.world_size)
            self.wrapped = self._ds.engine
        self.optimizer, self.lr_scheduler = optimizer, scheduler

        epoch, micro_done = 0, 0
        resume = ckpt.resolve_resume(args.output_dir, resume_from_checkpoint)
        if resume is not None:
            epoch, micro_done = self._load_checkpoint(resume)
            logger.info("resumed from %s at step %d", resume, self.global_step)

        n_params = unique_parameter_count(self.model)
        peak = peak_flops(self.device)
        log = TrainLogger(args, enabled=self.dist.is_main, total_steps=total, initial_step=self.global_step)
        params = [p for p in self.model.parameters() if p.requires_grad]
        check_every = 1 if self.device.type == "cpu" else every["logging_steps"]
        acc = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss x tokens, label tokens, inputs
        run_loss = [0.0, 0.0]  # loss x tokens, tokens over the whole run (read at each log)
        nonfinite = torch.zeros((), dtype=torch.int64, device=self.device)
        grad_norm = None
        t_log, start, start_step = time.perf_counter(), time.perf_counter(), self.global_step
        old_handler = self._install_sigterm()
        self.wrapped.train()
        try:
            while self.global_step < total:
                sampler.set_epoch(epoch, start=micro_done * bs)
                it = iter(loader)
                while self.global_step < total and (window := [b for _, b in zip(range(ga), it)]):
                    counts, totals = self._window_counts(window)
                    for i, batch in enumerate(window):
                        last = i == len(window) - 1
                        n_all = totals[0].clamp(min=1).float()
                        with self._sync(last):
                            # This micro-batch's share of the window's token mean; x dp_size undoes the
                            # averaging of gradients across processes.
                            if self._takes_num_items:
                                loss = self._forward(self.wrapped, batch, n_all)
                            else:
                                loss = self._forward(self.wrapped, batch) * (counts[i, 0].item() / n_all)
                            self._backward(loss * self.dp_size, last, len(window))
                        loss_sum = loss.detach().double() * n_all
                        acc[0] += loss_sum
                        nonfinite += (~torch.isfinite(loss_sum)).long()
                    grad_norm = self._optimizer_step(params)
                    acc[1:] += totals
                    self.global_step += 1
                    micro_done += len(window)
                    log.advance()
                    if self.global_step % check_every == 0 or self.global_step == total:
                        self._check_finite(nonfinite)
                    if self.global_step % every["logging_steps"] == 0 or self.global_step == total:
                        rec, loss_sum, n = self._metrics(acc, grad_norm, time.perf_counter() - t_log, n_params, peak,
                                                         epoch + micro_done / micro_per_epoch)
                        run_loss = [run_loss[0] + loss_sum, run_loss[1] + n]
                        acc.zero_()
                        self.log_history.append({"step": self.global_step, **rec})
                        log.log(self.global_step, rec)
                        t_log = time.perf_counter()
                    if args.eval_strategy == "steps" and self.global_step % eval_every == 0:
                        self._log_eval(log)
                    if args.save_strategy == "steps" and (self.global_step % every["save_steps"] == 0
                                                          or self.global_step == total):
                        self._save_checkpoint(epoch, micro_done)
                    if self._stop_requested():
                        self._save_checkpoint(epoch, micro_done)
                        log.log(self.global_step, {"stopped": "SIGTERM", "checkpoint": f"checkpoint-{self.global_step}"})
                        raise SystemExit(128 + signal.SIGTERM)
                if micro_done >= micro_per_epoch:  # the epoch ran to its end
                    epoch, micro_done = epoch + 1, 0
                    if args.eval_strategy == "epoch":
                        self._log_eval(log)
                    if args.save_strategy == "epoch":
                        self._save_checkpoint(epoch, micro_done)
        finally:
            self._restore_sigterm(old_handler)
            log.close()
        runtime = time.perf_counter() - start
        mean_loss = run_loss[0] / max(run_loss[1], 1)
        metrics = {"train_loss": mean_loss, "train_runtime": round(runtime, 3),
                   "train_steps_per_second": round((self.global_step - start_step) / max(runtime, 1e-9), 3)}
        return TrainOutput(self.global_step, mean_loss, metrics)

    # -- step pieces ------------------------------------------------------------------------------
    def _sync(self, last: bool):
        if self.strategy == "ddp":
            return ddp_mod.sync_context(self.wrapped, last)
        if self.strategy in ("fsdp", "fsdp+tp"):
            fsdp_mod.set_gradient_sync(self.model, last)
        return nullcontext()

    def _backward(self, loss: torch.Tensor, last: bool, window: int) -> None:
        if self._ds is not None:
            self._ds.micro_step(loss, last=last, accumulation_steps=window)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _optimizer_step(self, params) -> torch.Tensor | float | None:
        if self._ds is not None:
            return self._ds.grad_norm()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = clip_grad_norm(params, self.args.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _check_finite(self, nonfinite: torch.Tensor) -> None:
        bad = nonfinite.clone()
        if self.dist.is_distributed:
            dist.all_reduce(bad)
        if bad.item():
            where = (f"at step {self.global_step}" if self.device.type == "cpu"
                     else f"at or before step {self.global_step} (checked every logging_steps)")
            raise NonFiniteLossError(
                f"the training loss became nan/inf {where}. Lower learning_rate, use warmup_steps, keep "
                "max_grad_norm set, use bf16 rather than fp16, or check the data for empty label sets")

    def _dp_group(self):
        return self._tp_mesh["dp"].get_group() if hasattr(self, "_tp_mesh") else None

    def _metrics(self, acc, grad_norm, seconds, n_params, peak, epoch) -> tuple[dict, float, float]:
        """The log record of the steps since the last log, and its (loss x tokens, tokens) sums."""
        if self.dp_size > 1:
            loss_sum = acc[0].clone()
            dist.all_reduce(loss_sum, group=self._dp_group())
        else:
            loss_sum = acc[0]
        loss_sum, n, inputs = torch.stack([loss_sum, acc[1], acc[2]]).tolist()
        tokens_per_s = inputs / max(seconds, 1e-9)
        rec = {"loss": loss_sum / max(n, 1), "lr": self.lr_scheduler.get_last_lr()[0], "epoch": round(epoch, 4),
               "tokens_per_s": round(tokens_per_s, 1)}
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        if peak:
            # Four significant digits, not decimals: a small model's MFU is far below 1e-4.
            rec["mfu"] = float(f"{6 * n_params * tokens_per_s / (peak * self.dist.world_size):.4g}")
        if self.device.type == "cuda":
            rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        return rec, loss_sum, n

    def _log_eval(self, log: TrainLogger) -> None:
        rec = self.evaluate()
        self.log_history.append({"step": self.global_step, **rec})
        log.log(self.global_step, rec)

    @staticmethod
    def _interval(value: float, total: int) -> int:
        return max(1, math.ceil(value * total)) if 0 < value < 1 else int(value)

    # -- SIGTERM ----------------------------------------------------------------------------------
    def _install_sigterm(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            self._stop_signal = True
            logger.warning("SIGTERM: saving a checkpoint after this step, then exiting")

        return signal.signal(signal.SIGTERM, handler)

    def _restore_sigterm(self, old):
        if old is not None:
            signal.signal(signal.SIGTERM, old)

    def _stop_requested(self) -> bool:
        if not self.dist.is_distributed:
            return self._stop_signal
        flag = torch.tensor([int(self._stop_signal)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control)
        return bool(flag.item())

    # -- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict:
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if data is None:
            raise UnsupportedError("evaluate() needs an eval_dataset (here or in the Trainer)")
        loader, _ = self._loader(data, self.args.per_device_eval_batch_size, shuffle=False)
        model = self.wrapped.module if self.strategy == "ddp" else self.wrapped
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in loader:
            n = count_label_tokens(batch)
            if n == 0:
                continue
            loss = self._forward(model, batch).double() * n
            acc += torch.stack([loss, torch.tensor(float(n), dtype=torch.float64, device=self.device)])
        if self.dp_size > 1:
            dist.all_reduce(acc, group=self._dp_group())
        model.train(was_training)
        loss_sum, n = acc.tolist()
        return {"eval_loss": loss_sum / max(n, 1), "eval_tokens": int(n),
                "eval_runtime": round(time.perf_counter() - start, 3)}

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self.strategy in ("fsdp", "tp", "fsdp+tp")

    def _full_state_dict(self) -> dict:
        if self._ds is not None:
            return self._ds.full_state_dict()
        if self._sharded:
            return fsdp_mod.full_state_dict(self.model)
        return self.model.state_dict()

    def _save_checkpoint(self, epoch: int, micro_done: int) -> None:
        from ..distributed.init import barrier

        args, main = self.args, self.dist.is_main
        tmp = ckpt.begin(args.output_dir, self.global_step, main)
        barrier()
        if self._ds is not None:
            self._ds.save(tmp)
        elif self._sharded:
            fsdp_mod.save_sharded(tmp / "distcp", self.model, self.optimizer)
        elif main:
            ckpt.save_safetensors(self.model.state_dict(), tmp)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        if main:
            self._save_config(tmp)
            torch.save(self.lr_scheduler.state_dict(), tmp / "scheduler.pt")
            if self.scaler is not None:
                torch.save(self.scaler.state_dict(), tmp / "scaler.pt")
            state = {"global_step": self.global_step, "epoch": epoch, "micro_batches_in_epoch": micro_done,
                     "total_steps": self.total_steps, "world_size": self.dist.world_size,
                     "strategy": self.strategy, "log_history": self.log_history}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        torch.save(ckpt.rng_state(self.device), tmp / f"rng_state_{self.dist.rank}.pth")
        barrier()
        if main:
            ckpt.commit(args.output_dir, self.global_step, args.save_total_limit)
        barrier()

    def _load_checkpoint(self, path) -> tuple[int, int]:
        state = json.loads((path / "trainer_state.json").read_text())
        if state["world_size"] != self.dist.world_size or state["strategy"] != self.strategy:
            raise UnsupportedError(
                f"{path} was saved by {state['world_size']} process(es) with {state['strategy']}; resume with the "
                f"same launch (now {self.dist.world_size} with {self.strategy}), or load its weights as a model")
        if self._ds is not None:
            self._ds.load(path)
        elif self._sharded:
            fsdp_mod.load_sharded(path / "distcp", self.model, self.optimizer)
        else:
            ckpt.load_model_weights(self.model, ckpt.load_safetensors(path), str(path))
            self.optimizer.load_state_dict(ckpt.torch_load(path / "optimizer.pt"))
        self.lr_scheduler.load_state_dict(ckpt.torch_load(path / "scheduler.pt"))
        if self.scaler is not None:
            self.scaler.load_state_dict(ckpt.torch_load(path / "scaler.pt"))
        ckpt.set_rng_state(ckpt.torch_load(path / f"rng_state_{self.dist.rank}.pth"), self.device)
        self.global_step = state["global_step"]
        self.log_history = state["log_history"]
        return state["epoch"], state["micro_batches_in_epoch"]

    def _save_config(self, folder) -> None:
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(folder)

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained weights as plain safetensors (plus config and tokenizer): a model folder."""
        from ..distributed.init import barrier

        folder = output_dir or self.args.output_dir
        if not self._sharded and self._ds is None and hasattr(self.model, "save_pretrained"):
            if self.dist.is_main:  # the model's own format (a LoRA model writes its adapters)
                self.model.save_pretrained(folder)
        else:
            state = self._full_state_dict()  # a collective when the model is sharded
            if self.dist.is_main:
                ckpt.save_safetensors(state, folder)
                self._save_config(folder)
        if self.dist.is_main:
            if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(folder)
        barrier()
