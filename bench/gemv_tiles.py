"""The decode GEMV's tiling (``cudaformers.kernels.gemv.TILING``) swept end to end, on W1 and W2.

    python bench/gemv_tiles.py [--shapes qwen3-0.6b,qwen3-8b] [--top 4]

A batch-1 decode step chains about a hundred GEMVs of a few microseconds each, launched with
programmatic dependent launch: how many programs a GEMV has, how many weights each requests before
it waits for its input, and how many warps stream them decide the ramp-up and the tail of every
kernel, which a single kernel timed alone does not show. So each tiling is timed the way W1 runs:
generate() with 256 new tokens after a 128-token prompt, graphs captured again for each tiling.
Every tiling is swept on the first shape; the best ``--top`` and the default on the others.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, environment, random_checkpoint  # noqa: E402
from generate_overhead import call_ms  # noqa: E402

NEW = 256


def tok_per_s(model, ids, reps: int) -> float:
    model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None)  # capture
    return NEW / call_ms(model, ids, NEW, reps) * 1e3


def sweep(shape: str, tilings: list[dict], reps: int, env: dict, json_path: str | None) -> list[tuple[float, dict]]:
    from cudaformers import AutoModelForCausalLM
    from cudaformers.kernels import gemv

    model = AutoModelForCausalLM.from_pretrained(random_checkpoint(shape), dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation="triton", use_kernels=True)
    ids = torch.randint(1000, 100000, (1, 128), generator=torch.Generator().manual_seed(0)).cuda()
    default = dict(gemv.TILING)
    results = []
    for tiling in tilings:
        gemv.TILING.update(tiling)
        model.__dict__.pop("_decode_runners", None)  # new graphs: the tiling is fixed at capture
        rate = tok_per_s(model, ids, reps)
        results.append((rate, dict(tiling)))
        mark = " (default)" if tiling == default else ""
        print(f"  {shape} {tiling}: {rate:8.1f} tok/s{mark}", flush=True)
        emit(dict(bench="gemv_tiles", shape=shape, tiling=tiling, tok_s=round(rate, 1), **env), json_path)
    gemv.TILING.update(default)
    del model
    torch.cuda.empty_cache()
    return sorted(results, key=lambda r: -r[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--elements", default="4096,8192,16384")
    ap.add_argument("--programs-per-sm", default="2,4,8")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from cudaformers.kernels import gemv

    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    default = dict(gemv.TILING)
    grid = [dict(elements=e, programs_per_sm=p, warps=w) for e, p, w in itertools.product(
        *(map(int, s.split(",")) for s in (args.elements, args.programs_per_sm, args.warps)))]
    if default not in grid:
        grid.insert(0, default)
    shapes = args.shapes.split(",")
    ranked = sweep(shapes[0], grid, args.reps, env, args.json)
    best = [t for _, t in ranked[: args.top]]
    print(f"best on {shapes[0]}: " + "; ".join(f"{t} {r:.1f}" for r, t in ranked[: args.top]))
    for shape in shapes[1:]:
        ranked_other = sweep(shape, [default] + [t for t in best if t != default], args.reps, env, args.json)
        print(f"best on {shape}: " + "; ".join(f"{t} {r:.1f}" for r, t in ranked_other))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
