"""Shared pieces of the benchmarks: ceilings, random checkpoints in real shapes, environment facts."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=40960),
}


def environment() -> dict:
    import transformers

    import cudaformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, cuda=torch.version.cuda, triton=triton_version,
                transformers=transformers.__version__, cudaformers=cudaformers.__version__, commit=commit,
                python=platform.python_version())


def timed(fn, sync=True):
    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 / (start.elapsed_time(end) / 1000 / 10) / 1e12


def graph_us(calls, reps: int = 50, replays: int = 5) -> float:
    """Microseconds per call, replayed from one CUDA graph of ``reps`` calls: ``calls`` is one
    callable or a list cycled through (e.g. over weight copies that together overflow L2, so every
    call reads HBM). Warm-up (and Triton's compiles) runs outside the capture; best of ``replays``."""
    calls = calls if isinstance(calls, (list, tuple)) else [calls]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    del graph
    return best


def random_checkpoint(shape: str, folder: Path | None = None) -> Path:
    """Seeded random bf16 weights in the shape of a real model, saved by transformers."""
    import transformers

    folder = folder or Path(tempfile.gettempdir()) / f"bench-{shape}"  # shared by all bench scripts
    if (folder / "config.json").exists():
        return folder
    config = transformers.Qwen3Config(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def triton_variants() -> dict[str, set[str]]:
    """The specialisation keys of every compiled variant of every Triton kernel this process holds, by
    kernel name (Triton compiles one per divisibility of integer arguments and per constexpr set). A
    difference across a timed run names the kernels that compiled during it."""
    import gc
    import warnings

    from triton.runtime.jit import JITFunction

    found: dict[str, set[str]] = {}
    with warnings.catch_warnings():  # isinstance on some of torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, JITFunction):
                for entry in getattr(obj, "device_caches", {}).values():
                    found.setdefault(obj.__name__, set()).update(str(k) for k in entry[0])
    return found


def emit(record: dict, path: str | None = None) -> None:
    line = json.dumps(record, sort_keys=True)
    print("JSON " + line)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
