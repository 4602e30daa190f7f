"""generate()'s prompt pass over the static KV cache, eager or replayed from a CUDA graph.

An eager prompt pass of a small model is bound by the host (hundreds of launches at tens of µs
each, against a millisecond of GPU work), so on a GPU the pass is captured too. Every row is padded
at its end to a shared width, a multiple of ``WIDTH_STEP``: one graph per width serves every prompt
that rounds to it. Padding cannot change a real token's result: attention is causal, so no real
query sees a padded key, and the keys padding writes past a prompt lie where the decode steps write
their own before any step reads them. Eager passes on a GPU pad the same way, so graph and eager
runs compute the same thing.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from ..attention.metadata import AttentionBatch

WIDTH_STEP = 64
MAX_GRAPH_TOKENS = 8192  # larger passes are GPU-bound anyway; their graphs would hold much memory
MAX_GRAPHS = 4  # widths kept captured, least recently used dropped


def prompt_width(lens: list[int]) -> int:
    """Tokens per row of a padded prompt pass (size the cache for at least this many)."""
    return -(-max(lens) // WIDTH_STEP) * WIDTH_STEP


def padded_width(lens: list[int], device: torch.device, capacity: int) -> int | None:
    """The shared row width on a GPU, or None to run the rows unpadded (CPU, or no room to pad)."""
    width = prompt_width(lens)
    return width if device.type == "cuda" and width <= capacity else None


class PromptPass:
    """The prompt pass of a ``DecodeRunner``: logits of each row's last prompt token."""

    def __init__(self, runner, use_cuda_graph: bool):
        self._runner, self.use_cuda_graph = weakref.ref(runner), use_cuda_graph  # the runner owns this pass
        self.graphs: OrderedDict[int, tuple] = OrderedDict()  # width -> (graph, its inputs and output)

    @property
    def runner(self):
        return self._runner()

    def _slots(self, lens: list[int]) -> torch.Tensor:
        """Row r's tokens fill its own blocks from slot r * row_stride."""
        r = self.runner
        dev = r.block_table.device
        row_stride = r.block_table.shape[1] * r.block_size
        return torch.cat([torch.arange(n, device=dev) + i * row_stride for i, n in enumerate(lens)])

    def _batch(self, lens: list[int], dev):
        r = self.runner
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        return positions, AttentionBatch.with_cache(lens, lens, r.cache, self._slots(lens), r.block_table, dev)

    def _forward(self, ids: torch.Tensor, positions, batch, last: torch.Tensor) -> torch.Tensor:
        hidden = self.runner.model.model(ids, positions, batch)
        # Placed over several GPUs (device_map), the last layers and the head may sit on another
        # device than the inputs; the logits come back to the inputs' device, where the loop runs.
        return self.runner.model.compute_logits(hidden[last.to(hidden.device)]).to(ids.device)

    def __call__(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``[B, V]`` after each prompt in ``rows`` (1-D token tensors), written to the cache."""
        lens = [len(row) for row in rows]
        dev = rows[0].device
        width = padded_width(lens, dev, self.runner.capacity)
        if width is None:
            last = torch.tensor(lens, device=dev).cumsum(0) - 1
            return self._forward(torch.cat(rows), *self._batch(lens, dev), last)
        ids = torch.nn.functional.pad(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
                                      (0, width - max(lens)))
        last = torch.tensor(lens, device=dev) - 1 + torch.arange(len(rows), device=dev) * width
        if not self.use_cuda_graph or len(rows) * width > MAX_GRAPH_TOKENS:
            return self._forward(ids.view(-1), *self._batch([width] * len(rows), dev), last)
        graph, ids_buf, last_buf, logits, *_ = self._graph(width)
        ids_buf.copy_(ids)
        last_buf.copy_(last)
        graph.replay()
        return logits

    def _graph(self, width: int):
        if width in self.graphs:
            self.graphs.move_to_end(width)
            return self.graphs[width]
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        rows = self.runner.rows
        dev = self.runner.block_table.device
        ids = torch.zeros(rows, width, dtype=torch.long, device=dev)
        last = torch.arange(rows, device=dev) * width  # any in-range rows while capturing
        # Metadata is built outside the capture (it copies from the host); the warm-up run fills
        # the batch's memoised tensors, which the captured run then reads.
        positions, batch = self._batch([width] * rows, dev)
        graph, logits = self.runner.capture(lambda: self._forward(ids.view(-1), positions, batch, last), warmups=1)
        # The graph reads positions and the batch's tensors at every replay: they live as long as it.
        self.graphs[width] = (graph, ids, last, logits, positions, batch)
        return self.graphs[width]
