"""Reading safetensors checkpoints: single file or sharded, with errors that name the file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import CheckpointError

INDEX = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, checked to exist and be readable."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-download it") from e
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing from {folder}: {missing}; "
                                  "download the complete checkpoint")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = [n for n in PICKLE_NAMES if (folder / n).exists()]
    if pickles:
        raise CheckpointError(f"{folder} holds only pickled weights ({pickles[0]}), which cudaformers never loads "
                              "(they can run code). Convert them to safetensors once with a trusted tool.")
    raise CheckpointError(f"no model.safetensors (or sharded *.safetensors) in {folder}; "
                          "for a GGUF file pass gguf_file=...")


class SafetensorsCheckpoint:
    """The tensors of a checkpoint's safetensors files, read for where they are going: iterated, they
    are zero-copy views of the memory-mapped files (CPU); ``stream(device)`` brings them to a GPU
    through pinned buffers (loading/streaming.py)."""

    def __init__(self, files: list[Path]):
        self.files = files

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor, Path]]:
        return iter_safetensors(self.files)

    def stream(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor, Path]]:
        """Device tensors, each valid only until the next is requested (staging buffers are reused)."""
        from .streaming import stream_safetensors

        return stream_safetensors(self.files, device)


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """(name, tensor, file) for every tensor; tensors are zero-copy views of the memory-mapped file,
    so nothing larger than one tensor is ever materialised on the host."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors header ({e}). The file is corrupt or "
                                  "truncated: download it again.") from e
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({e}); the file is truncated "
                                          "or corrupt: download it again.") from e
                yield name, tensor, file
