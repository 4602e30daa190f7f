"""from_pretrained to one GPU against the disk: the qwen3-8b-shaped random bf16 checkpoint (written once
by bench/common.py and shared with the other benchmarks) read raw, streamed, and loaded by ours
(tensor-by-tensor path and streamed path) and by transformers, all from the page cache.

    python bench/load.py [--shape qwen3-8b] [--skip-hf] [--json out.jsonl]

raw 1 thread / N threads: plain sequential reads of every file into a reused buffer (the page-cache
ceiling). stream tN: loading/streaming.py alone, N reader threads, no model. ours: the issue's call,
from_pretrained(folder, dtype=bfloat16, device_map="cuda", attn_implementation="triton",
use_kernels=True), with CUDAFORMERS_STREAM_LOAD=0 (tensor by tensor from the mapped files) and =1
(streamed); the two must load identical weights. Nothing is dropped from the page cache (it cannot
be without root): the first raw read warms it. Each case is timed once, after a warm-up of CUDA.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, environment, random_checkpoint  # noqa: E402

PIECE = 32 << 20


def _files(folder: Path) -> list[Path]:
    from cudaformers.loading.safetensors import checkpoint_files

    return checkpoint_files(folder)


def raw_read(files: list[Path], threads: int) -> float:
    """Seconds to pread every byte of ``files`` in PIECE-sized pieces over ``threads`` threads."""
    buffers = [bytearray(PIECE) for _ in range(threads)]

    def read_span(args):
        fd, begin, end, buf = args
        view = memoryview(buf)
        for off in range(begin, end, PIECE):
            os.preadv(fd, [view[:min(PIECE, end - off)]], off)

    start = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        size = os.fstat(fd).st_size
        step = -(-size // threads // PIECE) * PIECE
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read_span, [(fd, b, min(b + step, size), buffers[i])
                                      for i, b in enumerate(range(0, size, step))]))
        os.close(fd)
    return time.perf_counter() - start


def stream_only(files: list[Path], threads: int) -> float:
    from cudaformers.loading.streaming import stream_safetensors

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in stream_safetensors(files, "cuda", threads=threads):
        pass
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ours(folder: Path, streamed: bool):
    from cudaformers import AutoModelForCausalLM

    os.environ["CUDAFORMERS_STREAM_LOAD"] = "1" if streamed else "0"
    torch.cuda.synchronize()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation="triton", use_kernels=True)
    torch.cuda.synchronize()
    return model, time.perf_counter() - start


def transformers_load(folder: Path) -> float:
    import transformers

    torch.cuda.synchronize()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    return seconds


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    env = environment()
    folder = random_checkpoint(args.shape)
    files = _files(folder)
    nbytes = sum(f.stat().st_size for f in files)
    torch.empty(1, device="cuda")  # CUDA context outside the timings
    threads = min(8, os.cpu_count() or 1)
    rows: list[tuple[str, float]] = []
    rows.append(("raw read, 1 thread (cold or warm)", raw_read(files, 1)))
    rows.append(("raw read, 1 thread", raw_read(files, 1)))
    rows.append((f"raw read, {threads} threads", raw_read(files, threads)))
    for n in sorted({1, 2, 4, threads}):
        rows.append((f"stream to cuda, {n} reader threads", stream_only(files, n)))
    new, seconds = ours(folder, streamed=True)
    rows.append(("ours streamed (CUDAFORMERS_STREAM_LOAD=1)", seconds))
    weights = new._choices.get("weights", "")
    old, seconds = ours(folder, streamed=False)
    rows.append(("ours tensor by tensor (CUDAFORMERS_STREAM_LOAD=0)", seconds))
    a, b = new.state_dict(), old.state_dict()
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    del new, old, a, b
    _free()
    new, seconds = ours(folder, streamed=True)
    rows.append(("ours streamed, again", seconds))
    del new
    _free()
    if not args.skip_hf:
        rows.append(("transformers", transformers_load(folder)))
        _free()
    hf = dict(rows).get("transformers")
    for name, s in rows:
        emit(dict(bench="load", shape=args.shape, case=name, seconds=round(s, 3), gbps=round(nbytes / 1e9 / s, 2),
                  identical=identical, **env), args.json)
    print(f"\n{args.shape}: {len(files)} files, {nbytes / 1e9:.2f} GB; {env['gpu']}, torch {env['torch']}, "
          f"transformers {env['transformers']}, commit {env['commit']}")
    print(f"streamed load's own report: {weights}")
    print(f"streamed and tensor-by-tensor loads identical: {'yes' if identical else 'NO'}")
    print(f"{'case':<52}{'seconds':>9}{'GB/s':>8}{'vs transformers':>17}")
    for name, s in rows:
        ratio = f"{hf / s:.2f}x" if hf and name.startswith("ours") else ""
        print(f"{name:<52}{s:>9.2f}{nbytes / 1e9 / s:>8.1f}{ratio:>17}")
    if not identical:
        sys.exit("streamed weights differ from the tensor-by-tensor load")


if __name__ == "__main__":
    main()
