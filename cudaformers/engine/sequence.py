"""Sequence: one request's tokens and its place in the engine (queue, KV blocks, progress).

A sequence's tokens are its prompt followed by what it has generated. ``num_computed_tokens`` of
them have their keys and values in the paged cache (written by a step already launched); the rest
still have to go through the model. A waiting prompt has all but its prefix-cache hits to compute;
a decoding sequence has exactly one (the token it sampled last). With async batching that last
token may not be known on the host yet: it is ``PLACEHOLDER`` until the step that samples it is read
back, and the model runner feeds it to the next step from the device.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams

PLACEHOLDER = -1  # a token sampled on the device whose value the host has not read yet


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled


_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        # Read for every sampled token: built once rather than per step.
        self.finish_token_ids: frozenset = params.finish_token_ids()
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_prefix_hit_tokens = 0  # tokens served from the prefix cache on the last admission
        # Chained hashes of the full blocks of token_ids, computed as blocks fill (prefix cache keys).
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0  # leading blocks of block_table already filed in the prefix cache
        self.logprobs: list[dict[int, float]] = []  # per output token, when params.logprobs is set
        self.text = ""  # detokenized output, kept only when stop strings need it
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.generator = None  # torch.Generator of a seeded request, made on its first draw

    # -- sizes ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_total_tokens(self, max_model_len: int) -> int:
        """The most tokens this sequence can ever hold: prompt + max_tokens, within the context."""
        cap = max_model_len
        if self.params.max_tokens is not None:
            cap = min(cap, self.num_prompt_tokens + self.params.max_tokens)
        return cap

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass
class RequestOutput:
    """What a finished (or streamed) request hands back."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    finished: bool = True
    metrics: dict = field(default_factory=dict)

    @staticmethod
    def from_sequence(seq: Sequence, text: str | None = None) -> "RequestOutput":
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            finished=seq.is_finished,
            metrics={"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                     "num_preemptions": seq.num_preemptions,
                     "num_prefix_hit_tokens": seq.num_prefix_hit_tokens},
        )
