"""Where the continuous-batching engine's time goes, step by step (W4-style offline run).

    python bench/profile_engine.py [--requests 128] [--new 256] [--csv steps.csv] [--kernels]
    python bench/profile_engine.py --fake [--requests 256]   # host cost only, stub model, any machine

Runs the W4 workload (prompt lengths uniform in [100, 1024], ``random.Random(0)``, greedy, EOS
ignored) on the qwen3-0.6b random checkpoint through ``LLMEngine`` with its default settings, after
a warm-up run. A ``step_observer`` records, per step: wall time, host time (wall minus blocking
read-backs), GPU time between CUDA events around the launch, decode / prefill token counts, KV
tokens read, and whether a CUDA graph was replayed. The summary splits the run into pure-decode
and mixed steps, gives GPU ms and effective KV bandwidth per decode batch-size bucket, host ms per
step, GPU idle gaps and the slowest steps (a compile or autotune stall shows up there).
``--kernels`` adds the top kernels of one mixed and one decode step (torch.profiler).

``--fake`` swaps the model for a stub whose forward costs nothing (tiny vocabulary, graphs
replayed as no-ops): what is left is the engine's own host work per step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

BUCKETS = [(1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 30)]


class StepTrace:
    """The engine's step observer: one row per ``step()`` call."""

    def __init__(self, cuda: bool):
        self.cuda, self.rows, self._row = cuda, [], None

    def _event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self):
        self._t0, self._wait, self._row = time.perf_counter(), 0.0, None

    def scheduled(self, batch):
        kv = sum(s.num_computed_tokens for s in batch.seqs) + batch.num_tokens
        self._row = dict(sched=time.perf_counter() - self._t0, seqs=len(batch.seqs), decode=batch.num_decodes,
                         prefill=batch.num_prefill_tokens, kv_tokens=kv, ev0=self._event())
        self._t1 = time.perf_counter()

    def launched(self, batch, graph_size):
        self._row.update(launch=time.perf_counter() - self._t1, graph=graph_size, ev1=self._event())

    def waited(self, seconds):
        self._wait += seconds

    def end(self, num_outputs):
        wall = time.perf_counter() - self._t0
        row = self._row or dict(sched=0.0, seqs=0, decode=0, prefill=0, kv_tokens=0, ev0=None, launch=0.0,
                                graph=None, ev1=None)
        row.update(wall=wall, wait=self._wait, host=wall - self._wait, outputs=num_outputs)
        self.rows.append(row)

    def finish(self):
        """Turn the CUDA events into GPU milliseconds (call after a synchronize)."""
        prev = None
        for r in self.rows:
            r["gpu"] = r["gap"] = 0.0
            if r["ev0"] is not None:
                r["gpu"] = r["ev0"].elapsed_time(r["ev1"]) / 1e3
                if prev is not None:
                    r["gap"] = max(0.0, prev.elapsed_time(r["ev0"]) / 1e3)
                prev = r["ev1"]


def kind(r) -> str:
    if not r["seqs"]:
        return "no launch"
    if r["prefill"] == 0:
        return "decode, graph" if r["graph"] is not None else "decode, eager"
    return "mixed" if r["decode"] else "prefill only"


def ms(x) -> str:
    return f"{x * 1e3:8.2f}"


def summarize(rows, seconds, out_tokens, kv_bytes_per_token, cuda):
    print(f"\n{len(rows)} steps, {seconds:.2f} s, {out_tokens} output tokens -> {out_tokens / seconds:,.0f} tok/s")
    print(f"\n{'step kind':<16} {'steps':>6} {'wall s':>8} {'GPU s':>8} {'host s':>8} {'dec tok':>8} "
          f"{'pre tok':>8} {'wall ms/step':>12}")
    for k in ("decode, graph", "decode, eager", "mixed", "prefill only", "no launch"):
        sel = [r for r in rows if kind(r) == k]
        if sel:
            wall = sum(r["wall"] for r in sel)
            print(f"{k:<16} {len(sel):>6} {wall:>8.2f} {sum(r['gpu'] for r in sel):>8.2f} "
                  f"{sum(r['host'] for r in sel):>8.2f} {sum(r['decode'] for r in sel):>8} "
                  f"{sum(r['prefill'] for r in sel):>8} {ms(wall / len(sel)):>12}")

    print("\npure decode steps by batch size: GPU ms, KV read bandwidth, host ms (wall minus read-back wait)")
    print(f"{'batch':<10} {'steps':>6} {'GPU ms':>8} {'KV GB/s':>8} {'host ms':>8} {'wall ms':>8} {'graph':>6}")
    for lo, hi in BUCKETS:
        sel = [r for r in rows if kind(r).startswith("decode") and lo <= r["seqs"] <= hi]
        if not sel:
            continue
        gpu = sum(r["gpu"] for r in sel)
        bw = sum(r["kv_tokens"] for r in sel) * kv_bytes_per_token / gpu / 1e9 if gpu else float("nan")
        graphed = sum(r["graph"] is not None for r in sel)
        print(f"{f'{lo}-{min(hi, 99999)}':<10} {len(sel):>6} {ms(gpu / len(sel))} {bw:>8.0f} "
              f"{ms(statistics.mean(r['host'] for r in sel))} {ms(statistics.mean(r['wall'] for r in sel))} "
              f"{graphed:>6}")

    host = sorted(r["host"] for r in rows)
    print(f"\nhost per step: mean {ms(statistics.mean(host))} ms, p50 {ms(host[len(host) // 2])} ms, "
          f"p90 {ms(host[int(len(host) * 0.9)])} ms; of it scheduling {ms(statistics.mean(r['sched'] for r in rows))}"
          f" ms, launch {ms(statistics.mean(r.get('launch', 0.0) for r in rows))} ms")
    if cuda:
        gaps = [r["gap"] for r in rows]
        busy = sum(r["gpu"] for r in rows)
        print(f"GPU busy {busy:.2f} s of {seconds:.2f} s ({busy / seconds:.0%}); idle gaps between steps "
              f"{sum(gaps):.2f} s in all, {sum(g > 1e-3 for g in gaps)} over 1 ms")
    print("\nslowest steps:")
    print(f"{'#':>5} {'kind':<14} {'seqs':>5} {'pre tok':>7} {'wall ms':>8} {'GPU ms':>8} {'host ms':>8} {'wait ms':>8}")
    for i in sorted(range(len(rows)), key=lambda i: -rows[i]["wall"])[:8]:
        r = rows[i]
        print(f"{i:>5} {kind(r):<14} {r['seqs']:>5} {r['prefill']:>7} {ms(r['wall'])} {ms(r['gpu'])} "
              f"{ms(r['host'])} {ms(r['wait'])}")


def requests(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(100, 1024) for _ in range(n)]
    return [[rng.randrange(1000, 100000) % vocab for _ in range(k)] for k in lens]


def real_engine(args):
    from common import random_checkpoint

    from cudaformers import AutoModelForCausalLM
    from cudaformers.engine.llm_engine import LLMEngine

    model = AutoModelForCausalLM.from_pretrained(random_checkpoint("qwen3-0.6b"), dtype=torch.bfloat16,
                                                 device_map="cuda", attn_implementation=args.attn,
                                                 use_kernels=not args.plain_layers)
    start = time.perf_counter()
    engine = LLMEngine(model)
    print(f"engine start (cache sizing, graph capture, warm-up): {time.perf_counter() - start:.1f} s")
    return engine


def fake_engine(args):
    """An engine whose model costs nothing: the stub returns fixed logits, graphs replay as no-ops."""
    from cudaformers.engine.cuda_graph import DecodeGraphs
    from cudaformers.engine.llm_engine import LLMEngine

    class Config:
        num_hidden_layers, num_key_value_heads, head_dim, vocab_size = 1, 1, 8, 64
        max_position_embeddings, eos_token_id = 40960, None

    class Stub(torch.nn.Module):
        device, dtype = torch.device("cpu"), torch.float32

        def __init__(self):
            super().__init__()
            self.config, self._choices = Config(), {}
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.logits = torch.randn(16384, Config.vocab_size)
            self.model = lambda ids, pos, batch: torch.zeros(ids.shape[0], 1)

        def attention_layers(self):
            return []

        def graph_blockers(self):
            return []

        def compute_logits(self, hidden):
            return self.logits[:hidden.shape[0]]

    class NoOpGraph:
        def replay(self):
            pass

    stub = Stub()
    engine = LLMEngine(stub, num_blocks=71627, use_async_batching=True)
    graphs = DecodeGraphs(engine.runner)
    for b in graphs.sizes:
        graphs.outputs[b], graphs.graphs[b] = stub.logits[:b], NoOpGraph()
    engine.runner.graphs = graphs
    return engine


def kernel_table(engine, inputs, params, title):
    """Top kernels by GPU time over the first steps that match ``title`` ("mixed" or "decode")."""
    from torch.profiler import ProfilerActivity, profile

    for ids in inputs:
        engine.add_request(ids, params)
    while engine.has_unfinished_requests():
        batch_kind = "mixed" if engine.scheduler.waiting else "decode"
        if batch_kind != title:
            engine.step()
            continue
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / 3 * 1e3
        averages = prof.key_averages()
        kernels = [e for e in averages if e.device_time_total > 0 and e.self_device_time_total > 0]
        busy_ms = sum(e.self_device_time_total for e in kernels) / 3 / 1e3
        rows = sorted(((e.key, e.device_time_total / 3, e.count // 3) for e in averages
                       if e.device_time_total > 0), key=lambda x: -x[1])[:12]
        # A step whose kernels are busy for all of its wall time is GPU-bound; much less, host-bound.
        print(f"\ntop kernels, {title} steps (GPU us per step, calls per step); kernels busy {busy_ms:.2f} ms "
              f"of {wall_ms:.2f} ms wall per step (under the profiler):")
        for name, us, n in rows:
            print(f"  {us:>9.0f} {n:>5}  {name[:90]}")
        break
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--new", type=int, default=256, help="new tokens per request")
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--fake", action="store_true", help="stub model: the engine's host cost only")
    ap.add_argument("--kernels", action="store_true", help="also profile the kernels of a mixed and a decode step")
    ap.add_argument("--plain-layers", action="store_true", help="load without use_kernels")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile the steps taken while prompts wait (mixed / prefill steps): where their host "
                         "time goes")
    ap.add_argument("--csv", default=None, help="write one line per step to this file")
    args = ap.parse_args(argv)

    from cudaformers.attention.kv_cache import KVCache
    from cudaformers.engine.sampling_params import SamplingParams

    engine = fake_engine(args) if args.fake else real_engine(args)
    cuda = engine.runner.is_cuda
    cfg, run = engine.model.config, engine.runner
    kv_per_token = KVCache.bytes_per_block(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim,
                                           engine.model.dtype)
    print(f"engine: max_batch_tokens={engine.scheduler.max_batch_tokens} max_num_seqs={engine.scheduler.max_num_seqs} "
          f"blocks={run.num_blocks}x{run.block_size} graphs={'on' if run.graphs else 'off'} "
          f"async={'on' if engine.use_async_batching else 'off'}")
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    vocab = run.vocab_size
    for ids in requests(8, vocab, seed=1):  # warm-up: first calls and compiles stay out of the timing
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    inputs = requests(args.requests, vocab)
    trace = StepTrace(cuda)
    if cuda:
        torch.cuda.synchronize()
        alloc_before = torch.cuda.memory_stats()
    start = time.perf_counter()
    seqs = [engine.add_request(ids, params) for ids in inputs]
    engine.step_observer = trace
    host_profile = None
    if args.host_profile:
        import cProfile

        host_profile = cProfile.Profile()
    while engine.has_unfinished_requests():
        if host_profile is not None and engine.scheduler.waiting:
            host_profile.enable()
            engine.step()
            host_profile.disable()
        else:
            engine.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine.step_observer = None
    trace.finish()
    out_tokens = sum(engine.requests[r].num_output_tokens for r in seqs)
    print(f"\nW4-style run: {len(inputs)} requests, {sum(map(len, inputs))} prompt tokens, {args.new} new each; "
          f"preemptions {engine.scheduler.num_preemptions}")
    summarize(trace.rows, seconds, out_tokens, kv_per_token, cuda)
    if cuda:  # cudaMalloc / cudaFree inside the timed run stall the host (a free synchronises the device)
        after = torch.cuda.memory_stats()
        print("allocator during the run: " + ", ".join(
            f"{k} +{after.get(k, 0) - alloc_before.get(k, 0)}"
            for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")))
    if host_profile is not None:
        import pstats

        print("\nhost profile of the steps taken while prompts waited (cProfile slows them; ranks count):")
        stats = pstats.Stats(host_profile).strip_dirs()
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_callers(12)  # who pays for the most expensive functions
    if args.csv:
        keys = ["wall", "host", "wait", "sched", "launch", "gpu", "gap", "seqs", "decode", "prefill", "kv_tokens",
                "graph", "outputs"]
        with open(args.csv, "w") as f:
            f.write(",".join(keys) + "\n")
            for r in trace.rows:
                f.write(",".join(str(r.get(k, "")) for k in keys) + "\n")
    if args.kernels and cuda:
        for rid in seqs:
            engine.release(rid)
        # Unseen prompts: the timed run's would hit the prefix cache and leave the prefill empty.
        fresh = requests(64, vocab, seed=2)
        kernel_table(engine, fresh, params, "mixed")
        kernel_table(engine, fresh, params, "decode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
