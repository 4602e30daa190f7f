"""Upper bounds: what W1 / W3 would reach if one kind of launch in the decode step cost nothing.

    python bench/ceilings.py [--workloads W1,W3] [--skips none,layer_norms,qk_norm_rope,attention,lm_head]

Each skip replaces a module's work with a pass-through after loading (no launch at all), so the
tokens are meaningless and only the time counts. The gap to ``none`` bounds what fusing that launch
into a neighbour could ever return, before deciding to build the fusion:

- ``layer_norms``: the decoder layers' two RMSNorms (at 5-32 rows they are separate launches; at one
  row they are folded into the GEMVs, and the skip drops the fold's first pass too);
- ``qk_norm_rope``: the per-head q/k norm, rotary and KV-cache store;
- ``attention``: the decode attention (the backend returns q);
- ``lm_head``: the vocabulary projection (a preallocated buffer comes back).

It also times the fixed cost of a call: ``generate`` of one new token (the prompt pass and setup).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, environment, random_checkpoint  # noqa: E402
from generate_overhead import call_ms  # noqa: E402

WORKLOADS = {"W1": 1, "W3": 32}
PROMPT, NEW = 128, 256


def _passthrough_norm(x, residual=None):
    return x if residual is None else (x, residual)


class _ReturnQuery:
    """An attention backend that attends to nothing: the queries come back as the output."""

    def __init__(self, backend):
        self.name = backend.name

    def __call__(self, q, k, v, *args, **kwargs):
        return q


def _skip(model, what: str) -> None:
    layers = model.model.layers
    if what == "layer_norms":
        for layer in layers:
            layer.input_layernorm.forward = _passthrough_norm
            layer.post_attention_layernorm.forward = _passthrough_norm
    elif what == "qk_norm_rope":
        for layer in layers:
            layer.self_attn.rotary.forward = lambda q, k, *args, **kwargs: (q, k)
    elif what == "attention":
        for layer in layers:
            layer.self_attn.backend = _ReturnQuery(layer.self_attn.backend)
    elif what == "lm_head":
        buffers = {}

        def head(x):
            rows = x.shape[:-1].numel()
            if rows not in buffers:
                buffers[rows] = torch.zeros(rows, model.config.vocab_size, device=x.device, dtype=x.dtype)
            return buffers[rows].view(*x.shape[:-1], -1)

        model.lm_head.forward = head
    elif what != "none":
        raise SystemExit(f"unknown skip {what!r}: none, layer_norms, qk_norm_rope, attention, lm_head")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="W1,W3")
    p.add_argument("--skips", default="none,layer_norms,qk_norm_rope,attention,lm_head,none")
    p.add_argument("--json")
    args = p.parse_args()
    from cudaformers import AutoModelForCausalLM

    folder = random_checkpoint("qwen3-0.6b")
    env = environment()
    rows = []
    for wl in args.workloads.split(","):
        batch = WORKLOADS[wl]
        ids = torch.randint(1000, 100000, (batch, PROMPT), generator=torch.Generator().manual_seed(0)).cuda()
        for what in args.skips.split(","):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                         attn_implementation="triton", use_kernels=True)
            _skip(model, what)
            call_ms(model, ids, NEW, 1)  # warm-up: compiles and captures
            full = call_ms(model, ids, NEW, 3) / 1e3
            one = call_ms(model, ids, 1, 5) / 1e3
            tok_s = batch * NEW / full
            per_step_ms = (full - one) / (NEW - 1) * 1e3
            rows.append((wl, what, tok_s, one * 1e3, per_step_ms))
            print(f"{wl} skip={what:13} {tok_s:10.1f} tok/s  one-token call {one * 1e3:6.2f} ms  "
                  f"per later token {per_step_ms:.4f} ms", flush=True)
            emit(dict(env, bench="ceilings", workload=wl, skip=what, tok_s=round(tok_s, 1),
                      one_token_ms=round(one * 1e3, 3), per_token_ms=round(per_step_ms, 4)), args.json)
            del model
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
