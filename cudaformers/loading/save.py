"""``save_pretrained``: config.json, generation_config.json and safetensors shards with an index."""

from __future__ import annotations

import json
from pathlib import Path



from .device_map import _parse_bytes


def save_pretrained(model, folder, max_shard_size="5GB", safe_serialization=True, state_dict=None) -> None:
    if not safe_serialization:
        raise ValueError("safe_serialization=False would write a pickle; cudaformers saves safetensors only")
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if state_dict is None:
        state_dict = getattr(model, "checkpoint_state_dict", model.state_dict)()
    if getattr(model.config, "tie_word_embeddings", False):
        state_dict.pop("lm_head.weight", None)
    limit = _parse_bytes(max_shard_size)
    shards, current, size = [], {}, 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    shards.append(current)
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
