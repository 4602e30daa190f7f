"""`cudaformers bench SUBJECT [options]`: runs a benchmark script from the repository's bench/ folder
(side by side with transformers), e.g. `cudaformers bench generate --workloads W1`."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from .errors import CudaformersError

SUBJECTS = {
    "generate": "generate.py", "serve-offline": "serve_offline.py", "serve-online": "serve_online.py",
    "train": "train.py", "kernels": "kernels.py", "attention": "attention.py", "quant": "quant.py",
    "profile-decode": "profile_decode.py",
}


def bench_folder() -> Path:
    folder = Path(__file__).resolve().parent.parent / "bench"
    if not (folder / "common.py").is_file():
        raise CudaformersError("the benchmarks live in the repository's bench/ folder, which this installation "
                               "does not have; clone the repository and install it with `pip install -e .`")
    return folder


def add_arguments(parser) -> None:
    parser.add_argument("subject", choices=sorted(SUBJECTS), help="what to measure")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options for the benchmark (see its --help)")


def run(args) -> int:
    script = bench_folder() / SUBJECTS[args.subject]
    sys.argv = [str(script), *args.options]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
    return 0
