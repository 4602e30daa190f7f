"""SamplingParams: how one request picks its tokens and when it stops.

Names and meanings follow vLLM's, so code written for it keeps working. Every field is checked
here, once, so the engine loop never meets a value it cannot honour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CudaformersError


class SamplingParamsError(CudaformersError, ValueError):
    """A sampling parameter is out of range or of the wrong type."""


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 keeps all
    min_p: float = 0.0  # drop tokens below min_p * probability of the most likely token
    repetition_penalty: float = 1.0  # transformers' rule: divide positive logits, multiply negative ones
    max_tokens: int | None = 16  # None: up to the context length
    stop_token_ids: list[int] | None = None  # finish on any of these (in addition to EOS)
    stop: list[str] | str | None = None  # finish when the text contains one of these; it is cut off
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the k most likely
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are out
    # Filled by the engine: the model's EOS ids (kept apart from the user's stop ids).
    _eos_token_ids: frozenset = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self):
        def fail(name, value, rule):
            raise SamplingParamsError(f"SamplingParams.{name}={value!r} is invalid: {rule}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            fail("temperature", self.temperature, "use a number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            fail("top_p", self.top_p, "use a number in (0, 1]; 1 disables it")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", self.top_k, "use a positive integer, or -1 / 0 to disable it")
        if not 0 <= self.min_p <= 1:
            fail("min_p", self.min_p, "use a number in [0, 1]; 0 disables it")
        if not self.repetition_penalty > 0:
            fail("repetition_penalty", self.repetition_penalty, "use a number > 0; 1 disables it")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", self.max_tokens, "use an integer >= 1, or None for up to the context length")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", self.min_tokens, "use an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", self.min_tokens, f"it must not exceed max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", self.logprobs, "use None or an integer >= 0 (how many top tokens to return)")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", self.seed, "use an integer or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(s, str) and s for s in self.stop):
                fail("stop", self.stop, "use a non-empty string or a list of non-empty strings")
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
                fail("stop_token_ids", self.stop_token_ids, "use a list of non-negative token ids")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """Sampling reads the request's earlier tokens (not only this step's logits)."""
        return self.repetition_penalty != 1.0

    def finish_token_ids(self) -> frozenset:
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids |= self._eos_token_ids
        return frozenset(ids)

    @classmethod
    def from_generation_config(cls, gen, max_new_tokens: int | None = None) -> "SamplingParams":
        """The SamplingParams equivalent of a transformers-style GenerationConfig."""
        do_sample = bool(getattr(gen, "do_sample", False))
        top_k = getattr(gen, "top_k", None)
        return cls(
            temperature=float(getattr(gen, "temperature", None) or 1.0) if do_sample else 0.0,
            top_p=float(getattr(gen, "top_p", None) or 1.0) if do_sample else 1.0,
            top_k=int(top_k) if do_sample and top_k else -1,
            min_p=float(getattr(gen, "min_p", None) or 0.0) if do_sample else 0.0,
            repetition_penalty=float(getattr(gen, "repetition_penalty", None) or 1.0),
            max_tokens=max_new_tokens if max_new_tokens is not None else getattr(gen, "max_new_tokens", None) or 20,
            min_tokens=int(getattr(gen, "min_new_tokens", None) or 0),
            seed=getattr(gen, "seed", None),
        )
