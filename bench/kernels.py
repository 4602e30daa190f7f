"""Each Triton kernel against its PyTorch reference and the transformers code it replaces.

Forward and forward+backward time (median, triton.testing.do_bench) and peak extra memory, bf16, on
one GPU, at the shapes of qwen3-8b (hidden 4096, intermediate 12288, 32/8 heads, vocab 151936) and
Qwen3-30B-A3B's MoE (128 experts, top-8). Prints a table, then one JSON line per row.

    python bench/kernels.py [--tokens 8192] [--only rms_norm,flce]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

DEV, DT = "cuda", torch.bfloat16


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


def cases(t: int):
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rotary

    from cudaformers.kernels import activation, fused_linear_cross_entropy as flce, mamba, moe, rms_norm, rotary

    h = 4096
    x, r, w = leaf(t, h), leaf(t, h), leaf(h)
    hf_norm = LlamaRMSNorm(h, eps=1e-6).to(DEV, DT)
    yield "rms_norm+residual", {
        "triton": lambda: rms_norm.rms_norm(x, w, 1e-6, r)[0],
        "reference": lambda: rms_norm.rms_norm_residual_reference(x, w, 1e-6, r)[0],
        "transformers": lambda: hf_norm(x + r)}
    q, k = leaf(t, 32, 128), leaf(t, 8, 128)
    emb = torch.arange(t, device=DEV).float()[:, None] * (1e6 ** (-torch.arange(0, 128, 2, device=DEV) / 128))
    cos, sin = torch.cat([emb, emb], -1).cos().to(DT), torch.cat([emb, emb], -1).sin().to(DT)
    yield "rotary q+k", {
        "triton": lambda: sum(o.float().sum() for o in rotary.apply_rotary(q * 1, k * 1, cos, sin)),
        "reference": lambda: sum(o.float().sum() for o in rotary.apply_rotary_reference(q, k, cos, sin)),
        "transformers": lambda: sum(o.float().sum() for o in hf_rotary(q.transpose(0, 1), k.transpose(0, 1),
                                                                       cos[None], sin[None]))}
    g, u = leaf(t, 12288), leaf(t, 12288)
    yield "silu_and_mul", {
        "triton": lambda: activation.act_and_mul(g, u, "silu"),
        "reference": lambda: activation.act_and_mul_reference(g, u, "silu"),
        "transformers": lambda: ACT2FN["silu"](g) * u}
    hid, lm = leaf(t, 1024), leaf(151936, 1024, scale=0.02)
    tgt = torch.randint(0, 151936, (t,), device=DEV)
    yield "linear+cross_entropy (V=151936, H=1024)", {
        "triton": lambda: flce.fused_linear_cross_entropy(hid, lm, tgt),
        "reference": lambda: flce.fused_linear_cross_entropy_reference(hid, lm, tgt),
        "transformers": lambda: torch.nn.functional.cross_entropy((hid @ lm.t()).float(), tgt)}
    e, topk, mh, mi = 128, 8, 2048, 768
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
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    rows = []
    for name, impls in cases(args.tokens):
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        for impl, fn in impls.items():
            for backward in (False, True):
                if backward and "fwd" in name:
                    continue
                try:
                    ms, mib = measure(fn, backward)
                    err = None
                except torch.cuda.OutOfMemoryError:
                    ms, mib, err = float("nan"), float("nan"), "OOM"
                    torch.cuda.empty_cache()
                rows.append(dict(kernel=name, impl=impl, mode="fwd+bwd" if backward else "fwd", ms=ms,
                                 peak_mib=mib, error=err))
    base = {(r["kernel"], r["mode"]): r["ms"] for r in rows if r["impl"] == "reference"}
    print(f"{'kernel':42} {'impl':13} {'mode':8} {'ms':>9} {'peak MiB':>9} {'vs ref':>7}")
    for r in rows:
        ratio = base.get((r["kernel"], r["mode"]), float("nan")) / r["ms"] if r["ms"] == r["ms"] else float("nan")
        r["speedup_vs_reference"] = ratio
        print(f"{r['kernel']:42} {r['impl']:13} {r['mode']:8} {r['ms']:9.3f} {r['peak_mib']:9.0f} {ratio:6.2f}x")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
