"""W1 with the batch-1 paged-decode split threshold changed: when does splitting a short context pay?

    python bench/paged_split_ab.py [--shape qwen3-0.6b] [--split-above 512,256,128]

generate()'s static cache sizes the decode grid for its capacity (512 keys at W1's 128 + 256
tokens), so a sequence past ``split_above`` keys is cut into one-tile (128-key) pieces that merge in
the same launch. The isolated kernel sweep (``bench/paged_decode.py``) sizes its grid for 16k keys,
where a 384-key context never splits, so this A/B runs W1 itself with each threshold.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, environment, random_checkpoint  # noqa: E402
from gemv_tiles import tok_per_s  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--split-above", default="512,256,128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from cudaformers import AutoModelForCausalLM
    from cudaformers.kernels import paged_decode as pd

    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}: {args.shape}")
    model = AutoModelForCausalLM.from_pretrained(random_checkpoint(args.shape), dtype=torch.bfloat16,
                                                 device_map="cuda", attn_implementation="triton", use_kernels=True)
    ids = torch.randint(1000, 100000, (1, 128), generator=torch.Generator().manual_seed(0)).cuda()
    default_tiling = pd.default_tiling
    for above in map(int, args.split_above.split(",")):
        def tiling(*a, above=above):
            return dataclasses.replace(default_tiling(*a), split_above=above) if a[0] * a[1] < 64 else default_tiling(*a)
        pd.default_tiling = tiling
        model.__dict__.pop("_decode_runners", None)
        rate = tok_per_s(model, ids, args.reps)
        print(f"  split_above {above}: {rate:8.1f} tok/s")
        emit(dict(bench="paged_split_ab", shape=args.shape, split_above=above, tok_s=round(rate, 1), **env), args.json)
    pd.default_tiling = default_tiling
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
