"""Training logs: a progress bar and readable lines on the console, one JSON object per log in
``output_dir/log.jsonl``, and TensorBoard when asked for. Only the main process writes.

MFU counts ``6 x parameters x tokens`` per second against the GPU's dense bf16 peak (a table below;
``CUDAFORMERS_PEAK_TFLOPS`` overrides it) — the forward/backward matmul work of a dense model,
ignoring attention, as the usual definition does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")

# Dense bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name().
_PEAK_BF16_TFLOPS = [("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
                     ("H800", 989.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
                     ("RTX 6000 Ada", 364.0), ("4090", 165.0), ("A10G", 70.0), ("A10", 125.0), ("L4", 121.0),
                     ("V100", 125.0), ("T4", 65.0)]


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when unknown (MFU is then not reported)."""
    env = os.environ.get("CUDAFORMERS_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def _format(metrics: dict) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            v = f"{v:.3e}" if k in ("lr",) or (v != 0 and abs(v) < 1e-3) else f"{v:.4g}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


class TrainLogger:
    """Writes each log to every sink; a no-op on processes other than the main one."""

    def __init__(self, args, *, enabled: bool, total_steps: int, initial_step: int = 0):
        self.enabled = enabled
        self.bar = self.tb = self.file = None
        if not enabled:
            return
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "log.jsonl", "a", buffering=1)
        reporters = set(args.report_to_list)
        if reporters & {"tensorboard", "all"}:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                if "tensorboard" in reporters:
                    raise UnsupportedError("report_to='tensorboard' but tensorboard is not installed; "
                                           "`pip install tensorboard` or drop it from report_to") from e
                logger.info("report_to='all': tensorboard is not installed, logging to console and log.jsonl")
            else:
                self.tb = SummaryWriter(args.logging_dir or str(out / "runs"))
        if not args.disable_tqdm:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)
        self.t0 = time.time()

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics, "time": round(time.time() - self.t0, 3)}
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        line = f"step {step}: {_format(metrics)}"
        if self.bar is not None:
            self.bar.set_postfix({k: metrics[k] for k in ("loss", "eval_loss") if k in metrics}, refresh=False)
            self.bar.write(line, file=sys.stderr)
        else:
            logger.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()
        self.bar = self.tb = self.file = None
