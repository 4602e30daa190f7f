"""Runs on several GPUs: distributed training against one GPU, tensor-parallel decode, device_map="auto".

    python bench/distributed.py train --strategy single                   # the baseline, one process
    torchrun --nproc_per_node=N bench/distributed.py train --strategy ddp   # or fsdp, tp
    torchrun --nproc_per_node=N bench/distributed.py infer-tp              # qwen3-8b shape, TP over N
    python bench/distributed.py device-map                                 # device_map="auto", all GPUs
    python bench/distributed.py report --json out.jsonl                    # the table of all of the above

train: a qwen3-0.6b-shaped model (random weights saved like the other benchmarks) trained for
``--steps`` steps with the Trainer, global batch 8 x 2048 tokens whatever the process count (8 / N
per process; tensor parallelism's processes all see the same 8), bf16 autocast, fp32 master weights, the same seeded data; each run appends its loss
curve and throughput, and ``report`` compares each curve with the single-process one (largest
relative difference) and gives tokens/s per GPU and the scaling efficiency against one GPU.
infer-tp: greedy generate() of a 128-token prompt with ``tp_plan="auto"``, its tokens against one
process's (rank 0 runs the model alone first) and the decode tokens/s of both.
device-map: the model placed over every visible GPU by ``device_map="auto"``, which layers went
where, the GPUs' names in CUDA's order, and greedy tokens against one GPU.
``--shape tiny`` runs everything small on the CPU (gloo), to try the script without GPUs.
NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), as everywhere in this project.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, emit, environment, random_checkpoint  # noqa: E402

GLOBAL_BATCH, SEQ, PROMPT, NEW = 8, 2048, 128, 128
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=4096)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def checkpoint(shape: str) -> Path:
    """The shared random checkpoint; rank 0 writes it, the others wait for it."""
    if shape != "tiny":
        folder = Path(tempfile.gettempdir()) / f"bench-{shape}"
    else:
        folder = Path(tempfile.gettempdir()) / "bench-distributed-tiny"
    if rank() == 0 and not (folder / "config.json").exists():
        if shape == "tiny":
            import transformers

            torch.manual_seed(0)
            config = transformers.Qwen3Config(**TINY, bos_token_id=None, eos_token_id=None, pad_token_id=None)
            transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        else:
            random_checkpoint(shape, folder)
    while not (folder / "config.json").exists():
        time.sleep(1)
    time.sleep(1 if world() > 1 else 0)  # the weights file is written before config.json is read back
    return folder


def run_train(args) -> dict:
    from cudaformers import AutoModelForCausalLM, Trainer, TrainingArguments

    cpu = args.shape == "tiny"
    seq = 64 if cpu else SEQ
    vocab = TINY["vocab_size"] if cpu else SHAPES[args.shape]["vocab_size"]
    data_parallel = 1 if args.strategy == "tp" else world()  # TP's processes share every batch
    if GLOBAL_BATCH % data_parallel:
        raise SystemExit(f"the global batch of {GLOBAL_BATCH} does not split over {data_parallel} processes")
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, vocab, (seq,), generator=g).tolist()}
            for _ in range(GLOBAL_BATCH * args.steps)]
    out = Path(tempfile.gettempdir()) / f"bench-distributed-{args.strategy}-{world()}"
    kw = dict(ddp={}, fsdp=dict(fsdp="full_shard"), tp=dict(tp_size=world()), single={})[args.strategy]
    targs = TrainingArguments(output_dir=str(out), per_device_train_batch_size=GLOBAL_BATCH // data_parallel,
                              max_steps=args.steps, learning_rate=1e-4, warmup_steps=2, logging_steps=1,
                              save_strategy="no", seed=0, bf16=not cpu, use_cpu=cpu, disable_tqdm=True,
                              report_to=[], **kw)
    model = AutoModelForCausalLM.from_pretrained(checkpoint(args.shape), dtype=torch.float32,
                                                 attn_implementation="sdpa", use_kernels=not cpu)
    trainer = Trainer(model, targs, train_dataset=data)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    if rank():
        return {}
    rows = [json.loads(line) for line in open(out / "log.jsonl")]
    losses = {int(r["step"]): r["loss"] for r in rows if "loss" in r}
    steady = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and int(r["step"]) > 2]
    peak = max((r.get("peak_mem_gib", 0) for r in rows), default=0)
    return dict(task="train", strategy=args.strategy, world=world(), shape=args.shape, steps=args.steps,
                losses=[losses[s] for s in sorted(losses)], logged_tok_s=statistics.median(steady) if steady else None,
                wall_s=round(wall, 2), wall_tok_s=round(GLOBAL_BATCH * seq * args.steps / wall, 1), peak_gib=peak)


def _decode(model, ids) -> tuple[torch.Tensor, float]:
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None)
    model.generate(ids, **kw)
    if ids.is_cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out[:, ids.shape[1]:].cpu(), NEW / (time.perf_counter() - t)


def run_infer_tp(args) -> dict:
    import torch.distributed as dist

    from cudaformers import AutoModelForCausalLM

    cpu = args.shape == "tiny"
    folder = checkpoint(args.shape)
    vocab = TINY["vocab_size"] if cpu else SHAPES[args.shape]["vocab_size"]
    dtype = torch.float32 if cpu else torch.bfloat16
    ids = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    # Both runs use sdpa and plain layers: the same math, so any difference is the split's rounding.
    device = "cpu" if cpu else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    quant = {}
    if args.quant:  # the packed int4/int8 weights split by hand (distributed/tp_quant.py)
        from cudaformers import Int4Config, Int8Config

        quant["quantization_config"] = Int8Config() if args.quant == "int8" else Int4Config(
            group_size=16 if cpu else 128)
    single = None
    if rank() == 0:  # one process alone first: the tokens TP must reproduce
        alone = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device, **quant)
        single = _decode(alone, ids.to(alone.device))
        del alone
        if not cpu:
            torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device, tp_plan="auto", **quant)
    tokens, tok_s = _decode(model, ids.to(model.device))
    del model  # its decode graphs hold collectives: gone before the process group is torn down
    if not cpu:
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    if rank():
        return {}
    same = int((tokens == single[0]).all(dim=1).sum()) == tokens.shape[0]
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens[0].tolist(), single[0][0].tolist())) if a != b), None)
    return dict(task="infer-tp", world=world(), shape=args.shape, quant=args.quant or "none", tokens_equal=same,
                first_difference=first_diff,
                tp_tok_s=round(tok_s, 1), single_tok_s=round(single[1], 1))


def run_device_map(args) -> dict:
    from cudaformers import AutoModelForCausalLM

    cpu = args.shape == "tiny"
    folder = checkpoint(args.shape)
    vocab = TINY["vocab_size"] if cpu else SHAPES[args.shape]["vocab_size"]
    dtype = torch.float32 if cpu else torch.bfloat16
    ids = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    placed = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="auto")
    devices = sorted({str(p.device) for p in placed.parameters()})
    tokens, tok_s = _decode(placed, ids.to(placed.device))
    explain = placed.explain()
    del placed
    one = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu" if cpu else "cuda:0")
    single, single_tok_s = _decode(one, ids.to(one.device))
    return dict(task="device-map", gpus=gpus, order=os.environ.get("CUDA_DEVICE_ORDER"),
                visible=os.environ.get("CUDA_VISIBLE_DEVICES"), devices=devices,
                tokens_equal=bool(torch.equal(tokens, single)), tok_s=round(tok_s, 1),
                single_tok_s=round(single_tok_s, 1), explain=explain)


def report(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    train = [r for r in rows if r.get("task") == "train"]
    base = next((r for r in train if r["strategy"] == "single"), None)

    def rate(r):  # the trainer's steady steps (the first compile Triton kernels), else the whole run
        return r.get("logged_tok_s") or r["wall_tok_s"]

    print(f"{'strategy':9} {'GPUs':>4} {'tok/s':>10} {'per GPU':>9} {'scaling':>8} {'max loss diff':>14} {'peak GiB':>9}")
    for r in train:
        per_gpu = rate(r) / r["world"]
        scaling = f"{per_gpu / rate(base):.0%}" if base else "-"
        diff = "-"
        if base and len(base["losses"]) == len(r["losses"]):
            diff = f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'], base['losses'])):.2e}"
        print(f"{r['strategy']:9} {r['world']:>4} {rate(r):>10.0f} {per_gpu:>9.0f} {scaling:>8} {diff:>14} "
              f"{r['peak_gib']:>9}")
    for r in rows:
        if r.get("task") == "infer-tp":
            weights = f" ({r['quant']} weights)" if r.get("quant", "none") != "none" else ""
            print(f"TP={r['world']} decode{weights}: tokens equal one GPU's: {r['tokens_equal']} (first difference at "
                  f"{r['first_difference']}); {r['tp_tok_s']} tok/s vs {r['single_tok_s']} on one GPU")
        if r.get("task") == "device-map":
            print(f"device_map='auto' over {r['gpus']} (order {r['order']}, visible {r['visible']}): weights on "
                  f"{r['devices']}, tokens equal one GPU's: {r['tokens_equal']}, {r['tok_s']} tok/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", choices=("train", "infer-tp", "device-map", "report"))
    ap.add_argument("--strategy", default="single", choices=("single", "ddp", "fsdp", "tp"))
    ap.add_argument("--shape", default=None, help="qwen3-0.6b for train, qwen3-8b for infer-tp (tiny: CPU)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quant", default=None, choices=("int4", "int8"), help="infer-tp: quantized weights")
    ap.add_argument("--json", default=None, help="append the JSON record here (report: read it)")
    args = ap.parse_args()
    if args.task == "report":
        report(args.json)
        return 0
    args.shape = args.shape or ("qwen3-0.6b" if args.task == "train" else "qwen3-8b")
    if args.strategy != "single" and "RANK" not in os.environ and args.task == "train":
        # One process is fine (one GPU checks the script and its NCCL setup), but it must come from torchrun.
        raise SystemExit(f"--strategy {args.strategy} runs under torchrun: torchrun --nproc_per_node=N")
    run = dict(train=run_train, **{"infer-tp": run_infer_tp, "device-map": run_device_map})[args.task]
    record = run(args)
    if record:
        emit({**record, "env": environment()}, args.json)
    import torch.distributed as dist

    if dist.is_initialized():  # a clean exit: gloo's threads may abort an interpreter that skips this
        dist.barrier()
        dist.destroy_process_group()
        # Even so, about one CPU FSDP run in 16 (torch 2.13, gloo) aborted in the interpreter's teardown,
        # after main had returned ("terminate called without an active exception", no Python frame):
        # the work and the record are done, so the process leaves without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
