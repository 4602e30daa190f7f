"""Server metrics in Prometheus' text format (no client library needed).

Counters and histograms are written by the engine thread once per step or per finished request
and read by the ``/metrics`` handler; a lock keeps a scrape consistent. Gauges (queue, running,
KV blocks) are read from the engine when scraped.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

PREFIX = "cudaformers"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 10.0


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, n in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.start_time = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time between a request's output tokens after the first.", TPOT_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from a request's arrival to its end.", E2E_BUCKETS)

    # -- engine thread ------------------------------------------------------------------------------
    def on_step(self, num_tokens: int, now: float) -> None:
        with self._lock:
            self.generation_tokens += num_tokens
            if num_tokens:
                self._recent.append((now, num_tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def on_finished(self, seq, now: float) -> None:
        reason = seq.finish_reason.value if seq.finish_reason else "abort"
        n_out = seq.num_output_tokens
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += seq.num_prompt_tokens
            self.e2e.observe(now - seq.arrival_time)
            if seq.first_token_time is not None:
                self.ttft.observe(seq.first_token_time - seq.arrival_time)
                if n_out > 1:
                    self.tpot.observe((now - seq.first_token_time) / (n_out - 1))

    # -- scrape -------------------------------------------------------------------------------------
    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            n = sum(k for t, k in self._recent if t >= now - RATE_WINDOW_S)
        return n / max(1e-9, min(RATE_WINDOW_S, now - self.start_time))

    def render(self, counts: dict) -> str:
        """The exposition text; ``counts`` is ``AsyncEngine.counts()``."""
        def metric(name, kind, help_text, value, labels=""):
            return [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}",
                    f"{PREFIX}_{name}{labels} {value}"]

        rate = self.tokens_per_second()
        lines = [
            *metric("requests_waiting", "gauge", "Requests queued for a place in the running batch.",
                    counts["waiting"]),
            *metric("requests_running", "gauge", "Requests in the running batch.", counts["running"]),
            *metric("kv_blocks_used", "gauge", "KV-cache blocks held by requests.", counts["blocks_used"]),
            *metric("kv_blocks_total", "gauge", "KV-cache blocks in all.", counts["blocks_total"]),
            *metric("kv_cache_usage_ratio", "gauge", "Share of KV-cache blocks in use.",
                    f"{counts['blocks_used'] / max(1, counts['blocks_total']):.4f}"),
            *metric("preemptions_total", "counter", "Requests preempted for lack of KV blocks.",
                    counts["preemptions"]),
            *metric("generation_tokens_per_second", "gauge",
                    f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.", f"{rate:.2f}"),
        ]
        with self._lock:
            lines += metric("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
            lines += metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                            self.prompt_tokens)
            lines += [f"# HELP {PREFIX}_requests_finished_total Finished requests by finish reason.",
                      f"# TYPE {PREFIX}_requests_finished_total counter"]
            lines += [f'{PREFIX}_requests_finished_total{{finish_reason="{r}"}} {n}'
                      for r, n in sorted(self.finished.items())]
            for h in (self.ttft, self.tpot, self.e2e):
                lines += h.render()
        return "\n".join(lines) + "\n"
