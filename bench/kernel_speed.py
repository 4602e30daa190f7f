"""Each Triton kernel against its PyTorch reference (and the transformers code it replaces), at W6's shapes.

W6 is a training step of qwen3-0.6b, 8 x 2048 tokens under bf16 autocast with fp32 master weights:
hidden 1024, intermediate 3072, 16/8 heads of 128, vocabulary 151936 (tied). Activations are bf16,
norm weights fp32 (so q/k norms hand fp32 to rotary, as in the model today). Forward and
forward+backward time (median, triton.testing.do_bench), the backward's share (their difference) and
peak extra memory; ``--extra`` adds the MoE and Mamba kernels at Qwen3-30B-A3B / Mamba shapes.
The fused cross-entropy does its matmuls during the forward, so its "fwd" is the whole thing.

    python bench/kernel_speed.py [--tokens 16384] [--only rms_norm,flce] [--extra]

(Not named kernels.py: the bench scripts put this folder first on sys.path, where a kernels.py would
stand in for the Hub's ``kernels`` package that transformers imports when it is installed.)
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

DEV, DT = "cuda", torch.bfloat16
H, I, HQ, HKV, D, V = 1024, 3072, 16, 8, 128, 151936


def measure(fn, backward: bool):
    def step():
        out = fn()
        if backward:
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward() if out.dim() else out.backward()
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return triton.testing.do_bench(step, warmup=5, rep=50), peak / 2**20


def leaf(*shape, scale=1.0, dtype=DT):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype).requires_grad_()


def autocast(fn):
    """``fn`` under bf16 autocast, as the training step runs it."""
    def run():
        with torch.autocast("cuda", dtype=DT):
            return fn()
    return run


def cases(t: int, extra: bool):
    from transformers.activations import ACT2FN
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as hf_rotary

    from cudaformers.kernels import activation, fused_linear_cross_entropy as flce, rms_norm, rotary

    x, r, w = leaf(t, H), leaf(t, H), leaf(H, dtype=torch.float32)
    hf_norm = Qwen3RMSNorm(H, eps=1e-6).to(DEV)
    yield "rms_norm+residual [T, 1024]", {
        "triton": lambda: rms_norm.rms_norm(x, w, 1e-6, r)[0],
        "reference": lambda: rms_norm.rms_norm_residual_reference(x, w, 1e-6, r)[0],
        "transformers": lambda: hf_norm(x + r)}
    for name, heads in (("q_norm", HQ), ("k_norm", HKV)):
        qk, wn = leaf(t, heads, D), leaf(D, dtype=torch.float32)
        yield f"rms_norm {name} [T, {heads}, 128]", {
            "triton": lambda qk=qk, wn=wn: rms_norm.rms_norm(qk, wn, 1e-6),
            "reference": lambda qk=qk, wn=wn: rms_norm.rms_norm_residual_reference(qk, wn, 1e-6)}
    emb = torch.arange(t, device=DEV).float()[:, None] * (1e6 ** (-torch.arange(0, D, 2, device=DEV) / D))
    cos, sin = torch.cat([emb, emb], -1).cos(), torch.cat([emb, emb], -1).sin()
    for dt in (torch.float32, DT):
        q, k = leaf(t, HQ, D, dtype=dt), leaf(t, HKV, D, dtype=dt)
        c, s_ = cos.to(dt), sin.to(dt)
        yield f"rotary q+k ({str(dt).removeprefix('torch.')})", {
            "triton": lambda q=q, k=k, c=c, s_=s_: sum(o.float().sum() for o in rotary.apply_rotary(q * 1, k * 1, c, s_)),
            "reference": lambda q=q, k=k, c=c, s_=s_: sum(o.float().sum()
                                                         for o in rotary.apply_rotary_reference(q, k, c, s_)),
            "transformers": lambda q=q, k=k, c=c, s_=s_: sum(o.float().sum() for o in hf_rotary(
                q.transpose(0, 1), k.transpose(0, 1), c[None], s_[None]))}
    gu = leaf(t, 2 * I)
    g, u = gu[:, :I], gu[:, I:]
    yield "silu_and_mul [T, 3072]", {
        "triton": lambda: activation.act_and_mul_packed(gu, "silu"),
        "reference": lambda: activation.act_and_mul_reference(g, u, "silu"),
        "transformers": lambda: ACT2FN["silu"](g) * u}
    hid, lm = leaf(t, H), leaf(V, H, scale=0.02, dtype=torch.float32)
    tgt = torch.randint(0, V, (t,), device=DEV)
    yield "linear+cross_entropy (V=151936, fp32 weight)", {
        "triton": autocast(lambda: flce.fused_linear_cross_entropy(hid, lm, tgt)),
        "reference": autocast(lambda: flce.fused_linear_cross_entropy_reference(hid, lm, tgt)),
        "transformers": autocast(lambda: torch.nn.functional.cross_entropy((hid @ lm.t()).float(), tgt))}
    if extra:
        yield from extra_cases(t)


def extra_cases(t: int):
    from cudaformers.kernels import mamba, moe

    e, topk, mh, mi = 128, 8, 2048, 768
    t = min(t, 8192)
    mx, gu, dn = leaf(t, mh), leaf(e, 2 * mi, mh, scale=mh ** -0.5), leaf(e, mh, mi, scale=mi ** -0.5)
    wts, idx = moe.route_reference(torch.randn(t, e, device=DEV), topk, True)
    yield "moe experts (128 x top-8)", {
        "triton": lambda: moe.moe_experts(mx, gu, dn, idx, wts.to(DT)),
        "reference": lambda: moe.moe_experts_reference(mx, gu, dn, idx, wts.to(DT))}
    mu = torch.randn(1, 1536, min(t, 2048), device=DEV, dtype=DT)
    mdt, mz = torch.randn_like(mu), torch.randn_like(mu)
    ma = -torch.rand(1536, 16, device=DEV)
    mb, mc = torch.randn(1, 16, mu.shape[-1], device=DEV, dtype=DT), torch.randn(1, 16, mu.shape[-1], device=DEV, dtype=DT)
    yield "mamba selective scan (fwd)", {
        "triton": lambda: mamba.selective_scan(mu, mdt, ma, mb, mc, None, mz)[0],
        "reference": lambda: mamba.selective_scan_reference(mu, mdt, ma, mb, mc, None, mz)[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--only", default="")
    parser.add_argument("--extra", action="store_true", help="also the MoE and Mamba kernels")
    args = parser.parse_args()
    rows = []
    for name, impls in cases(args.tokens, args.extra):
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        for impl, fn in impls.items():
            row = dict(kernel=name, impl=impl, error=None)
            for backward in (False, True):
                if backward and "fwd" in name:
                    continue
                try:
                    ms, mib = measure(fn, backward)
                except torch.cuda.OutOfMemoryError:
                    ms, mib, row["error"] = float("nan"), float("nan"), "OOM"
                    torch.cuda.empty_cache()
                row["fwd_bwd_ms" if backward else "fwd_ms"] = ms
                row["peak_mib"] = max(row.get("peak_mib", 0.0), mib)
            row["bwd_ms"] = row.get("fwd_bwd_ms", float("nan")) - row["fwd_ms"]
            rows.append(row)
    ref = {r["kernel"]: r for r in rows if r["impl"] == "reference"}
    print(f"tokens {args.tokens}; times in ms; 'x ref' = reference time / this time")
    print(f"{'kernel':46} {'impl':13} {'fwd':>8} {'bwd':>8} {'fwd+bwd':>8} {'x ref':>6} {'peak MiB':>9}")
    for r in rows:
        base = ref.get(r["kernel"], {}).get("fwd_bwd_ms", ref.get(r["kernel"], {}).get("fwd_ms", float("nan")))
        total = r.get("fwd_bwd_ms", r["fwd_ms"])
        r["speedup_vs_reference"] = base / total
        print(f"{r['kernel']:46} {r['impl']:13} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {total:8.3f} "
              f"{r['speedup_vs_reference']:5.2f}x {r['peak_mib']:9.0f}{'  ' + r['error'] if r['error'] else ''}")
    from cudaformers.kernels import fused_linear_cross_entropy as flce

    print(f"fused cross-entropy: chunk {flce._chunk_size(args.tokens, V, 2)} rows; fp32 weight gradient in the "
          f"matmul epilogue: {flce._FP32_EPILOGUE.get('cuda', 'not used')}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
