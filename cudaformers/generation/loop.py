"""generate()'s decode loop: sampling, stop rules and bookkeeping on the device, a step at a time.

What a step does after the model (min-new-tokens masking, repetition penalty, sampling, padding of
finished rows, the output column, stop flags) is ``advance``: fixed-shape tensor operations on
``LoopState`` with no host reads (for plain greedy decoding, one Triton launch). On a GPU the
model step and ``advance`` are captured together (``DecodeRunner.loop_graph``), so a step costs the
host one graph replay and the GPU no gaps between small launches. The host reads ``finished`` every
``SYNC_EVERY`` steps to stop early (``StopCheck``: on a GPU, the flag copied at the check before, so
the read never drains the queue of steps), or every step when a streamer or stop strings need the
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..device import triton_runs_on
from .logits import SamplingTensors, sample

SYNC_EVERY = 8
LAGGED_STOP_CHECK = True  # off: read the flag at once, draining the queue (bench/generate.py "+drainstop")


class StopCheck:
    """Whether every row has finished, read on the host without waiting for the GPU to go idle.

    On a GPU each ``__call__`` queues a copy of ``finished.all()`` into pinned host memory and
    answers from the copy queued at the call before, which the GPU passed about ``SYNC_EVERY`` steps
    ago: the host waits for that point while later steps are still queued, so the GPU never idles
    for the read (a plain ``bool(finished.all())`` drains the queue and leaves the GPU waiting for
    the next launch). A loop thus stops at most ``2 * SYNC_EVERY - 1`` steps after its last row
    finished; the extra columns are trimmed (``LoopState.result``). On the CPU it reads at once."""

    def __init__(self, finished: torch.Tensor):
        self.finished = finished
        self.lagged = finished.is_cuda and LAGGED_STOP_CHECK
        if self.lagged:
            self.flags = torch.zeros(2, dtype=torch.bool, pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
            self.calls = 0

    def __call__(self) -> bool:
        if not self.lagged:
            return bool(self.finished.all())
        slot = self.calls % 2
        self.flags[slot : slot + 1].copy_(self.finished.all().view(1), non_blocking=True)
        # on the copy's stream: the model may sit on another GPU than the current one
        self.events[slot].record(torch.cuda.current_stream(self.finished.device))
        self.calls += 1
        if self.calls == 1:
            return False
        self.events[1 - slot].synchronize()
        return bool(self.flags[1 - slot])


@dataclass(frozen=True)
class LoopKind:
    """What ``advance`` does, decided on the host once per call (it fixes the captured graph)."""
    sampling: bool
    top_k: bool
    top_p: bool
    min_p: bool
    penalty: bool
    min_new: bool  # eos ids are masked while fewer than min_new_tokens were generated
    eos_slots: int = 8  # room for this many eos ids

    @staticmethod
    def of(st: SamplingTensors, min_new: bool, num_eos: int) -> "LoopKind":
        slots = max(8, 1 << max(num_eos - 1, 0).bit_length())
        return LoopKind(st.use_sampling, st.use_top_k, st.use_top_p, st.use_min_p, st.use_penalty, min_new, slots)


class LoopState:
    """Device tensors of a decode loop over ``rows`` sequences of up to ``capacity`` new tokens.

    Fixed shapes, so one captured graph serves every later call: ``start`` refills them in place.
    ``tokens`` and ``positions`` are the model step's inputs (the last token of each row and its
    position); the caller may pass its own buffers for them.
    """

    def __init__(self, kind: LoopKind, rows: int, capacity: int, vocab: int, device, tokens=None, positions=None):
        self.kind, self.capacity = kind, capacity
        self.tokens = tokens if tokens is not None else torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = positions if positions is not None else torch.zeros(rows, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)  # the column advance writes next
        self.min_new = torch.zeros((), dtype=torch.long, device=device)
        self.max_new = torch.zeros((), dtype=torch.long, device=device)
        self.out = torch.zeros(rows, capacity, dtype=torch.long, device=device)  # [B, capacity]
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.ends = torch.zeros(rows, dtype=torch.long, device=device)  # tokens each row produced
        self.eos = torch.full((kind.eos_slots,), -1, dtype=torch.long, device=device)  # -1 pads: never a token
        self.pad = torch.zeros((), dtype=torch.long, device=device)  # what finished rows emit
        self.eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device) if kind.min_new else None
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device) if kind.penalty else None
        self.st = SamplingTensors.build([{}] * rows, device)  # values come with each call (start)
        self.st.use_sampling, self.st.use_top_k, self.st.use_top_p = kind.sampling, kind.top_k, kind.top_p
        self.st.use_min_p, self.st.use_penalty = kind.min_p, kind.penalty

    def start(self, st: SamplingTensors, seen, eos: torch.Tensor, pad: int, min_new: int, max_new: int,
              positions: torch.Tensor) -> None:
        """Per-call values into the fixed buffers; ``positions`` [B] is where the first new token goes."""
        if max_new > self.capacity:
            raise ValueError(f"max_new_tokens {max_new} exceeds the loop's capacity {self.capacity}")
        eos = eos[eos >= 0]
        if eos.numel() > self.eos.numel():
            raise ValueError(f"{eos.numel()} eos ids for a loop built for {self.eos.numel()} (LoopKind.of sizes it)")
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
            getattr(self.st, name).copy_(getattr(st, name))
        if self.seen is not None:
            self.seen.copy_(seen)
        self.eos.fill_(-1)
        self.eos[: eos.numel()] = eos
        if self.eos_mask is not None:
            self.eos_mask.zero_()
            self.eos_mask[eos] = True
        self.pad.fill_(pad)
        self.step.zero_()
        self.min_new.fill_(min_new)
        self.max_new.fill_(max_new)
        self.out.fill_(pad)
        self.finished.zero_()
        self.ends.fill_(max_new)
        # positions holds the position of the token in ``tokens``: the prompt's last one until
        # ``advance`` records the first new token (each advance moves both).
        self.positions.copy_(positions - 1)

    def result(self, steps: int) -> torch.Tensor:
        """The generated tokens ``[B, n]``, columns past the last row's end dropped (the loop may run
        a few steps past it between checks). A copy: the buffers serve the next call."""
        return self.out[:, : min(int(self.ends.max()), steps)].clone()


def advance(logits: torch.Tensor, state: LoopState, generator: torch.Generator | None = None) -> None:
    """Samples this step's token per row from ``logits [B, V]`` and records it as the next step's
    input (``tokens``, ``positions`` + 1); no host reads.

    Plain greedy decoding takes one Triton launch (``kernels/greedy_advance.py``) where Triton runs
    (CUDA, or the interpreter); everything else, and the CPU, runs ``advance_torch``."""
    # Triton is imported only where it runs; supports() checks the kind and the tensors.
    if generator is None and triton_runs_on(logits.device):
        from ..kernels.greedy_advance import greedy_advance, supports

        if supports(logits, state):
            greedy_advance(logits, state)
            return
    advance_torch(logits, state, generator)


def advance_torch(logits: torch.Tensor, state: LoopState, generator: torch.Generator | None = None) -> None:
    """``advance`` as torch ops, for every kind (the greedy kernel's reference)."""
    step = state.step
    logits = logits.float()
    if state.eos_mask is not None:
        logits = logits.masked_fill(state.eos_mask & (step < state.min_new), float("-inf"))
    tokens = sample(logits, state.st, state.seen, generator)
    tokens = torch.where(state.finished, state.pad, tokens)
    state.out.index_copy_(1, step.view(1), tokens[:, None])
    state.finished |= (tokens[:, None] == state.eos[None, :]).any(1)
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)
    close_finished(state, state.step + 1)
    state.tokens.copy_(tokens)
    state.positions += 1
    state.step += 1


def close_finished(state: LoopState, end) -> None:
    """Rows newly marked finished produced ``end`` tokens."""
    state.ends.copy_(torch.where(state.finished & (state.ends == state.max_new), end, state.ends))


def run_loop(first_logits: torch.Tensor, step: Callable[[], None], state: LoopState, max_new: int,
             generator=None, on_token: Callable[[int], None] | None = None) -> torch.Tensor:
    """Step 0 from the prompt's ``first_logits``, then ``step()`` (model + ``advance``, maybe one graph
    replay) until ``max_new`` tokens or every row finished. ``on_token(i)`` runs after each step."""
    advance(first_logits, state, generator)
    steps = 1
    if on_token is not None:
        on_token(0)
    all_finished = StopCheck(state.finished)
    while steps < max_new:
        if steps % SYNC_EVERY == 0 and all_finished():
            break
        step()
        if on_token is not None:
            on_token(steps)
        steps += 1
    return state.result(steps)
