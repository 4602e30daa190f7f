"""Training data: examples of token ids or text, padding or packing, and a resumable sharded sampler.

An example is a dict with ``input_ids`` (and optionally ``labels``, ``attention_mask``), a dict with
``text``, or a plain string; text is tokenised by the tokenizer the Trainer was given. ``labels``
follow transformers: the model shifts them, so ``labels[t + 1]`` is the target of position ``t`` and
-100 is ignored.

Packing concatenates documents into rows of at most ``block`` tokens with no padding. A packed batch
is flat (``input_ids[T]``, ``positions[T]``, ``labels[T]``) plus the document lengths, from which the
Trainer builds an ``AttentionBatch`` so attention stays inside each document; the first label of each
document is -100 so no document is asked to predict the next one's first token.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Sequence

import torch

from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")
IGNORE_INDEX = -100


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise UnsupportedError("the dataset holds text but the Trainer has no tokenizer; pass "
                               "processing_class=tokenizer (or tokenise to input_ids yourself)")
    out = tokenizer.encode(text) if hasattr(tokenizer, "encode") else tokenizer(text)["input_ids"]
    return list(getattr(out, "ids", out))


def to_example(item: Any, tokenizer, max_len: int | None) -> dict:
    """One raw dataset item -> {'input_ids': list[int], 'labels': list[int] | None}."""
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise UnsupportedError(f"a dataset item is a {type(item).__name__}; each item must be a dict with "
                               "'input_ids' (token ids) or 'text', or a plain string")
    if "input_ids" in item:
        ids = item["input_ids"]
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        labels = item.get("labels")
        labels = None if labels is None else (labels.tolist() if isinstance(labels, torch.Tensor) else list(labels))
        mask = item.get("attention_mask")
        if mask is not None:
            mask = mask.tolist() if isinstance(mask, torch.Tensor) else list(mask)
            if labels is None and not all(mask):
                labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    elif "text" in item:
        ids, labels = _encode(tokenizer, item["text"]), None
    else:
        raise UnsupportedError(f"a dataset item has keys {sorted(item)}; it needs 'input_ids' or 'text'")
    if labels is not None and len(labels) != len(ids):
        raise UnsupportedError(f"an example has {len(ids)} input_ids but {len(labels)} labels; they must match")
    if max_len is not None and len(ids) > max_len:
        ids, labels = ids[:max_len], None if labels is None else labels[:max_len]
    return {"input_ids": ids, "labels": labels}


class ExampleDataset(torch.utils.data.Dataset):
    """A map-style view that turns raw items into examples on access (tokenising text lazily)."""

    def __init__(self, data, tokenizer=None, max_len: int | None = None):
        if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
            raise UnsupportedError(f"{type(data).__name__} is not a map-style dataset (indexable, with a length); "
                                   "pass a list, a torch Dataset or a datasets.Dataset (not an IterableDataset)")
        self.data, self.tokenizer, self.max_len = data, tokenizer, max_len

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return to_example(self.data[i], self.tokenizer, self.max_len)


def pack(lengths: Sequence[int], block: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing: indices of the documents that share each row of ``block`` tokens."""
    bins: list[list[int]] = []
    space: list[tuple[int, int]] = []  # (free tokens, bin index), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        j = bisect.bisect_left(space, (n, -1))
        if j == len(space):
            bins.append([i])
            bisect.insort(space, (block - n, len(bins) - 1))
        else:
            free, b = space.pop(j)
            bins[b].append(i)
            bisect.insort(space, (free - n, b))
    return bins


class PackedDataset(torch.utils.data.Dataset):
    """Rows of whole documents, each row at most ``block`` tokens; longer documents are cut into pieces."""

    def __init__(self, examples: ExampleDataset, block: int):
        docs: list[dict] = []
        for i in range(len(examples)):
            ex = examples[i]
            ids, labels = ex["input_ids"], ex["labels"] if ex["labels"] is not None else ex["input_ids"]
            for s in range(0, len(ids), block):
                if len(ids[s:s + block]) >= 2:  # a 1-token document has nothing to predict
                    docs.append({"input_ids": ids[s:s + block], "labels": labels[s:s + block]})
        if not docs:
            raise UnsupportedError("packing found no document with at least 2 tokens in the dataset")
        self.rows = [[docs[i] for i in sorted(b)] for b in pack([len(d["input_ids"]) for d in docs], block)]
        used = sum(len(d["input_ids"]) for d in docs)
        logger.info("packing: %d documents into %d rows of <= %d tokens (%.1f%% filled)",
                    len(docs), len(self.rows), block, 100.0 * used / (len(self.rows) * block))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> list[dict]:
        return self.rows[i]


class PadCollator:
    """Examples -> right-padded ``input_ids``/``attention_mask``/``labels`` ``[B, S]``."""

    def __init__(self, pad_token_id: int = 0):
        self.pad = pad_token_id

    def __call__(self, examples: list[dict]) -> dict:
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), width), self.pad, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for r, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[r, :n] = torch.tensor(e["input_ids"])
            labels[r, :n] = torch.tensor(e["labels"] if e["labels"] is not None else e["input_ids"])
            mask[r, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PackedCollator:
    """Packed rows -> one flat batch: ``input_ids``/``positions``/``labels`` ``[T]`` and ``seqlens``."""

    def __call__(self, rows: list[list[dict]]) -> dict:
        docs = [d for row in rows for d in row]
        ids = torch.tensor([t for d in docs for t in d["input_ids"]], dtype=torch.long)
        positions = torch.cat([torch.arange(len(d["input_ids"])) for d in docs])
        labels = torch.tensor([t for d in docs for t in d["labels"]], dtype=torch.long)
        labels[positions == 0] = IGNORE_INDEX
        return {"input_ids": ids, "positions": positions, "labels": labels,
                "seqlens": [len(d["input_ids"]) for d in docs]}


def count_label_tokens(batch: dict) -> int:
    """Tokens that carry a loss after the model's shift by one."""
    labels = batch["labels"]
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def count_input_tokens(batch: dict) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


class ShardedSampler(torch.utils.data.Sampler):
    """Each rank's share of a (seed, epoch)-determined order; ``start`` skips samples on resume.

    The order depends only on the seed and the epoch, never on a global RNG, so resuming mid-epoch
    visits exactly the samples an uninterrupted run would have, without loading the skipped ones.
    """

    def __init__(self, n: int, *, rank: int = 0, world_size: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        self.n, self.rank, self.world, self.shuffle, self.seed = n, rank, world_size, shuffle, seed
        self.drop_last = drop_last
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if self.drop_last:
            return order[: self.n - self.n % self.world]
        pad = (-self.n) % self.world  # every rank gets the same count; repeat the first samples
        return order + (order * (pad // max(1, self.n) + 1))[:pad]

    @property
    def samples_per_epoch(self) -> int:
        """This rank's samples in a whole epoch (``len`` is what is left after ``start``)."""
        return len(self._order()) // self.world

    def __len__(self) -> int:
        return max(0, self.samples_per_epoch - self.start)

    def __iter__(self):
        return iter(self._order()[self.rank::self.world][self.start:])
