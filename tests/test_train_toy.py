"""A tiny Llama-shaped model with the cudaformers call signatures, and a launcher for multi-process
tests on the CPU (gloo). Shared by the training and distributed tests."""

from __future__ import annotations

import json
import os
import socket
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from cudaformers.attention.metadata import AttentionBatch
from cudaformers.attention.registry import get_backend


class ToyConfig:
    model_type = "llama"

    def __init__(self, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64, dropout=0.0):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.dropout = intermediate_size, dropout
        self.head_dim = hidden_size // num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


def rope(x, positions, base=10000.0):  # x [T, H, D]
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].to(x.dtype), torch.cat([ang.sin()] * 2, -1)[:, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim)  # as Qwen3: a replicated weight inside the sharded region

    def forward(self, x, positions, batch):
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, -1, self.head_dim))
        k = self.k_proj(x).view(t, -1, self.head_dim)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        backend = get_backend("sdpa", device=x.device, dtype=q.dtype, head_dim=self.head_dim, training=True)
        out = backend(q, k, v, batch, 0, self.head_dim ** -0.5, None)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.hidden_size), RMSNorm(c.hidden_size)
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x, positions, batch):
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), positions, batch))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size)


class ToyLM(nn.Module):
    """HF-style ``(input_ids[B,S], attention_mask, labels)`` and flat ``(input_ids[T], positions, batch,
    labels)`` calls; ``labels`` are shifted inside, -100 ignored, loss = mean over target tokens."""

    def __init__(self, config: ToyConfig | None = None, seed: int = 0):
        super().__init__()
        self.config = config or ToyConfig()
        torch.manual_seed(seed)
        self.model = Inner(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None, positions=None, batch=None):
        if input_ids.dim() == 2:  # right-padded [B, S] -> flat tokens
            mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
            seqlens = mask.sum(1).tolist()
            positions = torch.cat([torch.arange(n, device=input_ids.device) for n in seqlens])
            batch = AttentionBatch.from_seqlens(seqlens, input_ids.device)
            targets = None
            if labels is not None:
                shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
                targets = shifted[mask]
            input_ids = input_ids[mask]
        else:
            targets = None if labels is None else torch.cat([labels[1:], labels.new_full((1,), -100)])
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, batch)
        logits = self.lm_head(self.model.norm(x)).float()
        loss = None if targets is None else F.cross_entropy(logits, targets, ignore_index=-100)
        return {"loss": loss, "logits": logits}


def token_dataset(n: int, seed: int = 0, min_len: int = 5, max_len: int = 17, vocab: int = 64) -> list[dict]:
    """Learnable sequences (each a noisy arithmetic progression mod vocab) of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        start, step = (int(v) for v in torch.randint(0, vocab, (2,), generator=g))
        out.append({"input_ids": [(start + i * (step % 4 + 1)) % vocab for i in range(length)]})
    return out


# -- multi-process runs on the CPU --------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, kwargs, results_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result = {"ok": True, "value": fn(**kwargs)}
    except BaseException as e:  # reported to the parent, which fails the test with it
        result = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_processes(fn, world: int, results_dir, timeout: float = 240, **kwargs) -> list:
    """Run ``fn(**kwargs)`` in ``world`` gloo processes; return each rank's value (raises on failure).

    Judged by what each rank reported: gloo's threads sometimes abort the interpreter's exit after the
    work is done, which says nothing about the work.
    """
    import time

    import torch.multiprocessing as mp

    for r in range(world):  # a report left by an earlier run must not stand in for this one
        if os.path.exists(os.path.join(results_dir, f"rank{r}.json")):
            os.remove(os.path.join(results_dir, f"rank{r}.json"))
    ctx = mp.start_processes(_worker, args=(world, free_port(), fn, kwargs, str(results_dir)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                break
        except mp.ProcessExitedException:
            break
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world} processes did not finish in {timeout} s")
    for p in ctx.processes:
        p.join(timeout=30)
    values = []
    for r in range(world):
        path = os.path.join(results_dir, f"rank{r}.json")
        if not os.path.exists(path):
            raise AssertionError(f"rank {r} died without reporting (exit code {ctx.processes[r].exitcode})")
        res = json.load(open(path))
        if not res["ok"]:
            raise AssertionError(f"rank {r} failed: {res['error']}")
        values.append(res["value"])
    return values


def test_padded_and_packed_calls_agree():
    model = ToyLM()
    data = token_dataset(3)
    lens = [len(d["input_ids"]) for d in data]
    ids = torch.zeros(3, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(data):
        ids[i, : lens[i]] = torch.tensor(d["input_ids"])
        mask[i, : lens[i]] = 1
    labels = ids.masked_fill(mask == 0, -100)
    padded = model(input_ids=ids, attention_mask=mask, labels=labels)["loss"]
    flat_ids = torch.cat([torch.tensor(d["input_ids"]) for d in data])
    positions = torch.cat([torch.arange(n) for n in lens])
    flat_labels = flat_ids.clone()
    flat_labels[positions == 0] = -100
    packed = model(input_ids=flat_ids, positions=positions, batch=AttentionBatch.from_seqlens(lens, "cpu"),
                   labels=flat_labels)["loss"]
    torch.testing.assert_close(packed, padded)
