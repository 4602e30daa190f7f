"""Decode-step kernels at qwen3-0.6b shapes: the unfused path vs the fused kernels, timed in CUDA graphs.

    python bench/decode_kernels.py

Each op is captured 100 times into one CUDA graph and replayed, so the times are per launch as a
graph-replayed decode step sees them (no Python or launch overhead from the host). Rows:
  * q/k norm + rope: rms_norm(q) + rms_norm(k) + rotary (q, k in place) vs qk_norm_rope, on q/k
    views of a packed q/k/v projection output;
  * kv store: index_copy_ x 2 vs the one-launch Triton store;
  * gated MLP down projection: act_and_mul + GEMV vs the GEMV that applies silu(gate) * up as it loads
    its input (gate/up views of the packed gate/up output, I=3072 -> H=1024);
  * silu(gate) * up on the packed gate/up views at T=32: with the copies to contiguous inputs the
    kernel used to make vs reading the views through their row stride;
  * residual add + RMSNorm feeding the packed q/k/v and gate/up GEMVs at T=1: rms_norm + GEMV vs the
    GEMV with the norm folded in (gemv_rms_norm), cycling through weight copies that overflow L2;
  * paged decode at several contexts and graph capacities (generate() captures with its cache
    capacity, the engine with up to 16k), with the automatic split plan vs a single split.
A second table: one decoder layer's GEMV + norm chain at T=1 (rms_norm + residual -> qkv GEMV -> o
GEMV -> rms_norm + residual -> gate/up GEMV -> gated down GEMV) at qwen3-0.6b and qwen3-8b shapes,
replayed in a CUDA graph with programmatic dependent launch off (CUDAFORMERS_PDL=0) and on, and on
with both norms folded into the GEMVs after them (4 launches): us per layer and the weight bandwidth
it reaches. Layers cycle through enough distinct weights to keep L2 cold.
The first table runs with the default (PDL on where the GPU supports it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402
from cudaformers.kernels.activation import act_and_mul, act_and_mul_forward  # noqa: E402
from cudaformers.kernels.gemv import gemv, gemv_act_mul, gemv_rms_norm  # noqa: E402
from cudaformers.kernels.kv_store import store_kv_triton  # noqa: E402
from cudaformers.kernels.paged_decode import paged_decode, split_plan  # noqa: E402
from cudaformers.kernels.pdl import pdl_enabled  # noqa: E402
from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward  # noqa: E402
from cudaformers.kernels.rms_norm import rms_norm  # noqa: E402
from cudaformers.kernels.rotary import apply_rotary  # noqa: E402

HQ, HKV, D, PAGE, DTYPE, DEV = 16, 8, 128, 16, torch.bfloat16, "cuda"
HIDDEN, INTERMEDIATE = 1024, 3072


def norm_rope_rows(t: int):
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, dtype=DTYPE)
    q, k = qkv[:, :HQ * D].view(t, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    qw, kw = torch.rand(D, device=DEV, dtype=DTYPE) + 0.5, torch.rand(D, device=DEV, dtype=DTYPE) + 0.5
    pos = torch.arange(t, device=DEV, dtype=torch.float32) + 130
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)

    def old():
        apply_rotary(rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), cos, sin)

    def new():
        qk_norm_rope_forward(q, k, cos, sin, qw, kw, 1e-6, 1e-6)

    return [(f"q/k norm + rope, T={t}", "3 launches", graph_us(old), "1 launch", graph_us(new))]


def kv_store_rows(t: int):
    blocks = 64
    k_cache = torch.zeros(blocks, PAGE, HKV, D, device=DEV, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, dtype=DTYPE)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    slots = torch.randperm(blocks * PAGE, device=DEV)[:t]
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)

    def old():
        flat_k.index_copy_(0, slots, k)
        flat_v.index_copy_(0, slots, v)

    def new():
        store_kv_triton(k_cache, v_cache, k, v, slots)

    return [(f"kv store, T={t}", "index_copy x2", graph_us(old), "kv_store", graph_us(new))]


def act_down_rows(t: int):
    gate, up = torch.randn(t, 2 * INTERMEDIATE, device=DEV, dtype=DTYPE).split(INTERMEDIATE, dim=-1)
    w = torch.randn(HIDDEN, INTERMEDIATE, device=DEV, dtype=DTYPE) / INTERMEDIATE ** 0.5

    def old():
        gemv(act_and_mul_forward(gate, up, "silu"), w)

    def new():
        gemv_act_mul(gate, up, w, activation="silu")

    return [(f"silu*up + down proj, T={t}", "act + gemv", graph_us(old), "fused gemv", graph_us(new))]


def act_mul_rows(t: int):
    gate, up = torch.randn(t, 2 * INTERMEDIATE, device=DEV, dtype=DTYPE).split(INTERMEDIATE, dim=-1)

    def old():
        act_and_mul(gate.contiguous(), up.contiguous(), "silu")

    def new():
        act_and_mul(gate, up, "silu")

    return [(f"silu*up on packed views, T={t}", "2 copies + act", graph_us(old), "strided act", graph_us(new))]


def norm_gemv_rows(t: int):
    rows = []
    for what, n, copies in (("q/k/v", (HQ + 2 * HKV) * D, 8), ("gate/up", 2 * INTERMEDIATE, 6)):
        weights = [torch.randn(n, HIDDEN, device=DEV, dtype=DTYPE) / HIDDEN ** 0.5 for _ in range(copies)]
        x, residual = (torch.randn(t, HIDDEN, device=DEV, dtype=DTYPE) for _ in range(2))
        norm_w = torch.rand(HIDDEN, device=DEV, dtype=DTYPE) + 0.5

        def old(w):
            return lambda: gemv(rms_norm(x, norm_w, 1e-6, residual=residual)[0], w)

        def new(w):
            return lambda: gemv_rms_norm(x, w, norm_w, 1e-6, residual)

        rows.append((f"add + rms_norm + {what} proj, T={t}", "norm + gemv", graph_us([old(w) for w in weights]),
                     "folded gemv", graph_us([new(w) for w in weights])))
    return rows


# name -> (hidden, q heads, kv heads, head dim, intermediate, distinct layers to cycle through)
LAYER_SHAPES = {"qwen3-0.6b": (1024, 16, 8, 128, 3072, 8), "qwen3-8b": (4096, 32, 8, 128, 12288, 2)}
LAYER_REPEATS = 4  # passes over the distinct layers per graph


def layer_chain_row(name: str):
    """(name, us per layer: PDL off, on, on with the norms folded; weight GB per layer) for one decoder
    layer's GEMV + norm chain."""
    hidden, hq, hkv, d, inter, n_layers = LAYER_SHAPES[name]

    def w(*shape):
        return torch.randn(*shape, device=DEV, dtype=DTYPE) * shape[-1] ** -0.5

    layers = [dict(n1=torch.ones(hidden, device=DEV, dtype=DTYPE), n2=torch.ones(hidden, device=DEV, dtype=DTYPE),
                   qkv=w((hq + 2 * hkv) * d, hidden), o=w(hidden, hq * d), gate_up=w(2 * inter, hidden),
                   down=w(hidden, inter)) for _ in range(n_layers)]
    weight_bytes = sum(t.numel() * t.element_size() for t in layers[0].values())
    x = torch.randn(1, hidden, device=DEV, dtype=DTYPE)

    def model():
        h, residual = x, x
        for _ in range(LAYER_REPEATS):
            for p in layers:
                normed, residual = rms_norm(h, p["n1"], 1e-6, residual=residual)
                qkv = gemv(normed, p["qkv"])
                o = gemv(qkv[:, :hq * d], p["o"])  # attention left out: q stands in for its output
                normed, residual = rms_norm(o, p["n2"], 1e-6, residual=residual)
                gate_up = gemv(normed, p["gate_up"])
                h = gemv_act_mul(gate_up[:, :inter], gate_up[:, inter:], p["down"])

    def folded():
        h, residual = x, x
        for _ in range(LAYER_REPEATS):
            for p in layers:
                qkv, residual = gemv_rms_norm(h, p["qkv"], p["n1"], 1e-6, residual)
                o = gemv(qkv[:, :hq * d], p["o"])
                gate_up, residual = gemv_rms_norm(o, p["gate_up"], p["n2"], 1e-6, residual)
                h = gemv_act_mul(gate_up[:, :inter], gate_up[:, inter:], p["down"])

    times, saved = {}, os.environ.get("CUDAFORMERS_PDL")
    for key, pdl, chain in (("off", "0", model), ("on", "1", model), ("folded", "1", folded)):
        os.environ["CUDAFORMERS_PDL"] = pdl  # read at each launch, so at capture
        assert pdl_enabled(x.device) == (pdl == "1")
        times[key] = graph_us(chain, reps=1) / (LAYER_REPEATS * n_layers)
    if saved is None:
        del os.environ["CUDAFORMERS_PDL"]
    else:
        os.environ["CUDAFORMERS_PDL"] = saved
    return name, times["off"], times["on"], times["folded"], weight_bytes / 1e9


def paged_decode_rows(batch: int):
    rows = []
    for capacity in (512, 16384):
        blocks_per_seq = capacity // PAGE
        k_cache = torch.randn(batch * blocks_per_seq, PAGE, HKV, D, device=DEV, dtype=DTYPE)
        v_cache = torch.randn_like(k_cache)
        table = torch.arange(batch * blocks_per_seq, device=DEV, dtype=torch.int32).view(batch, blocks_per_seq)
        q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE)
        splits, _ = split_plan(batch, HKV, capacity, q.device, 64)
        for context in (130, 1024, 8192):
            if context > capacity:
                continue
            seqlens = torch.full((batch,), context, device=DEV, dtype=torch.int32)

            def run(num_splits=None):
                return lambda: paged_decode(q, k_cache, v_cache, seqlens, table, capacity, D ** -0.5,
                                            num_splits=num_splits)

            rows.append((f"paged decode B={batch} ctx={context} cap={capacity}", "1 split", graph_us(run(1)),
                         f"{splits} splits (auto)", graph_us(run())))
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for t in (1, 32):
            rows += norm_rope_rows(t) + kv_store_rows(t)
        rows += act_down_rows(1) + act_mul_rows(32) + norm_gemv_rows(1)
        for batch in (1, 32):
            rows += paged_decode_rows(batch)
        hopper = torch.cuda.get_device_capability()[0] >= 9
        pdl_rows = [layer_chain_row(name) for name in LAYER_SHAPES] if hopper else []
    print(f"\n{torch.cuda.get_device_name()}  (Hq={HQ}, Hkv={HKV}, D={D}, {str(DTYPE)[6:]}; us per launch, graph replay)")
    header = ("op", "baseline", "us", "ours", "us", "speedup")
    table = [header] + [(name, a, f"{ta:.2f}", b, f"{tb:.2f}", f"{ta / tb:.2f}x") for name, a, ta, b, tb in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) if i in (0, 1, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if not pdl_rows:
        print("\nprogrammatic dependent launch: not available here (needs sm90+), layer chain not timed")
        return
    print(f"\none decoder layer's GEMV + norm chain (6 launches; 4 with the norms folded), T=1, {str(DTYPE)[6:]}, "
          "graph replay:")
    header = ("shape", "weights MB", "PDL off us", "GB/s", "PDL on us", "GB/s", "folded us", "GB/s", "vs off")
    table = [header] + [(name, f"{gb * 1e3:.1f}", f"{off:.2f}", f"{gb / off * 1e6:.0f}", f"{on:.2f}",
                         f"{gb / on * 1e6:.0f}", f"{fold:.2f}", f"{gb / fold * 1e6:.0f}", f"{off / fold:.2f}x")
                        for name, off, on, fold, gb in pdl_rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    main()
