"""Checkpoints: ``checkpoint-N/`` folders written atomically, and the model as plain safetensors.

A checkpoint holds the model (safetensors, or a sharded torch.distributed.checkpoint folder when the
model is sharded), the optimizer, the scheduler, each rank's RNG states and ``trainer_state.json``.
It is written to ``checkpoint-N.tmp`` and renamed when complete, so a crash mid-save never leaves a
folder that looks finished; resuming looks only at finished folders. Everything is loaded with
``weights_only=True``: no pickled code runs on resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from ..errors import CheckpointError

_CKPT = re.compile(r"^checkpoint-(\d+)$")
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


# -- model weights as safetensors ------------------------------------------------------------------
def save_safetensors(state_dict: dict, folder: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a state dict as HF-style safetensors (sharded with an index above ``max_shard_bytes``).

    Tensors that share storage (tied embeddings) are written once, under their first name, as
    transformers does; loading restores the tie.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    seen, tensors = set(), {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.device.type != "meta" else name
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().to("cpu").contiguous()
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = t, size + nbytes
    shards.append(cur)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / SAFE_WEIGHTS), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def load_safetensors(folder: str | os.PathLike) -> dict:
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / SAFE_WEIGHTS).is_file():
        return load_file(str(folder / SAFE_WEIGHTS))
    if (folder / SAFE_INDEX).is_file():
        files = sorted(set(json.loads((folder / SAFE_INDEX).read_text())["weight_map"].values()))
        out = {}
        for f in files:
            out.update(load_file(str(folder / f)))
        return out
    raise CheckpointError(f"{folder} has no {SAFE_WEIGHTS} or {SAFE_INDEX}; is it a checkpoint folder?")


def load_model_weights(model: torch.nn.Module, state: dict, where: str) -> None:
    """Load ``state`` into ``model``; only tied weights (written once) may be missing."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    ptr = {}
    for k, t in own.items():
        ptr.setdefault(t.untyped_storage().data_ptr(), []).append(k)
    tied = {k for names in ptr.values() if len(names) > 1 for k in names}
    really_missing = [k for k in missing if k not in tied]
    if really_missing or unexpected:
        raise CheckpointError(f"{where} does not match the model: missing {really_missing[:5]}, "
                              f"unexpected {unexpected[:5]}; was it saved from a different model?")
    model.load_state_dict(state, strict=False)


# -- RNG states --------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict:
    state = {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
             "python_gauss": random.getstate()[2], "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": pos,
                          "has_gauss": has_gauss, "gauss": gauss}
    except ImportError:
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# -- folders --------------------------------------------------------------------------------------------
def torch_load(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete (pick another checkpoint-N)")
    return torch.load(path, map_location="cpu", weights_only=True)


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoints in ``output_dir``, oldest first."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if p.is_dir() and (m := _CKPT.match(p.name))
             and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def resolve_resume(output_dir: str, resume) -> Path | None:
    """``resume_from_checkpoint`` (None, True or a path) -> the folder to resume from."""
    if resume is None or resume is False:
        return None
    if resume is True:
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"resume_from_checkpoint=True but {output_dir} has no finished checkpoint-N "
                                  "folder; train without it first, or pass a checkpoint path")
        return found[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{path} is not a finished checkpoint (no trainer_state.json); "
                              "pass a checkpoint-N folder written by the Trainer")
    return path


def tmp_dir(output_dir: str, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}.tmp"


def begin(output_dir: str, step: int, is_main: bool) -> Path:
    tmp = tmp_dir(output_dir, step)
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crash mid-save
        tmp.mkdir(parents=True)
    return tmp


def commit(output_dir: str, step: int, save_total_limit: int | None) -> Path:
    """Rename the finished tmp folder into place (main process only), then drop old checkpoints."""
    tmp, final = tmp_dir(output_dir, step), Path(output_dir) / f"checkpoint-{step}"
    if final.exists():  # the same step saved again (a resumed run): the new one replaces it
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    if save_total_limit:
        for stale in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(stale, ignore_errors=True)
    return final
