"""bench/distributed.py, the script of the multi-GPU runs, end to end on the CPU (``--shape tiny``,
gloo): one process, then two under torchrun for DDP and tensor-parallel training and TP decode, and
the report. The curves match the single process's and TP's tokens equal one process's, so the
script that a machine with several GPUs runs is known to work before one is lent."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "bench" / "distributed.py")


def _run(args, tmp_path, procs=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, SCRIPT] if procs is None else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--standalone", SCRIPT]
    done = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_tiny_runs_match_one_process(tmp_path):
    out = str(tmp_path / "multi.jsonl")
    _run(["train", "--strategy", "single", "--shape", "tiny", "--steps", "4", "--json", out], tmp_path)
    for strategy in ("ddp", "fsdp", "tp"):
        _run(["train", "--strategy", strategy, "--shape", "tiny", "--steps", "4", "--json", out], tmp_path, procs=2)
    _run(["infer-tp", "--shape", "tiny", "--json", out], tmp_path, procs=2)
    _run(["infer-tp", "--shape", "tiny", "--quant", "int4", "--json", out], tmp_path, procs=2)
    rows = [json.loads(line) for line in open(out)]
    train = {r["strategy"]: r for r in rows if r["task"] == "train"}
    assert set(train) == {"single", "ddp", "fsdp", "tp"} and all(train[s]["world"] == 2 for s in ("ddp", "fsdp", "tp"))
    for strategy in ("ddp", "fsdp", "tp"):  # the same loss curve as one process (fp32 on the CPU)
        for a, b in zip(train[strategy]["losses"], train["single"]["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (strategy, train[strategy]["losses"], train["single"]["losses"])
    infer = {r["quant"]: r for r in rows if r["task"] == "infer-tp"}
    assert set(infer) == {"none", "int4"}
    assert all(r["world"] == 2 and r["tokens_equal"] is True for r in infer.values())
    report = _run(["report", "--json", out], tmp_path)
    assert "TP=2 decode: tokens equal one GPU's: True" in report and "ddp" in report
    assert "TP=2 decode (int4 weights): tokens equal one GPU's: True" in report


def test_a_strategy_outside_torchrun_says_how_to_launch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, SCRIPT, "train", "--strategy", "ddp", "--shape", "tiny"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "torchrun --nproc_per_node=N" in done.stderr
