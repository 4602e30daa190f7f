"""GGUF checkpoints (llama.cpp's format) for llama-architecture models: config, tensors, tokenizer.

The file is parsed with the ``gguf`` package, imported only when a GGUF is opened so that
``import cudaformers`` works without it. Tensors are dequantized in torch on the target device (see
gguf_dequant.py), renamed to Hugging Face names, and the q/k rows that llama.cpp's converter permuted
for its rope layout are put back, so the result loads like the original safetensors checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
from functools import lru_cache
from typing import Iterator

import numpy as np
import torch

from ..errors import CheckpointError, UnsupportedError
from .gguf_dequant import SUPPORTED_TYPES, dequantize

logger = logging.getLogger("cudaformers")

# GGUF block name -> Hugging Face module path inside model.layers.N
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading a GGUF file needs the gguf package: pip install gguf") from e
    return gguf


@lru_cache(maxsize=4)
def _open(path: str, mtime: float):
    # The reader memory-maps the file; config, tokenizer and tensors of one load share it.
    return _gguf().GGUFReader(path)


def open_gguf(path: str | os.PathLike):
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no GGUF file at {path}; pass the folder and the file name: "
                              "from_pretrained(folder, gguf_file='model.gguf')")
    try:
        return _open(os.path.abspath(path), os.path.getmtime(path))
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file ({e}); re-download it") from e


def read_metadata(path: str | os.PathLike) -> dict:
    """Every metadata key of the file -> its value (str, int, float, bool or list of those)."""
    fields = open_gguf(path).fields
    out = {}
    for key, field in fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _architecture(meta: dict, path) -> tuple[str, str]:
    """(the file's architecture prefix, our model_type)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedError(f"{path}: GGUF architecture {arch!r} is not supported; GGUF loading supports "
                               "'llama' (Llama, SmolLM, Mistral); use the safetensors checkpoint instead")
    # llama.cpp stores Mistral models as "llama"; transformers tells them apart by name, and so do we.
    name = str(meta.get("general.name", "")).lower()
    return arch, "mistral" if "mistral" in name else "llama"


def read_gguf_config(path: str | os.PathLike) -> dict:
    """A config.json-style dict for the model in a GGUF file."""
    meta = read_metadata(path)
    arch, model_type = _architecture(meta, path)

    def key(name, default=None, required=True):
        full = f"{arch}.{name}"
        if full not in meta and required and default is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {full!r}; the file is incomplete or not a model")
        return meta.get(full, default)

    tensor_names = {t.name for t in open_gguf(path).tensors}
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    if "tokenizer.ggml.tokens" in meta:
        vocab_size = len(meta["tokenizer.ggml.tokens"])
    else:
        vocab_size = key("vocab_size")
    config = {
        "model_type": model_type,
        "architectures": ["MistralForCausalLM" if model_type == "mistral" else "LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", vocab_size)),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        if f"tokenizer.ggml.{theirs}" in meta:
            config[ours] = int(meta[f"tokenizer.ggml.{theirs}"])
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedError(f"{path}: rope scaling {scaling!r} in a GGUF file is not supported "
                                   "(only 'linear'); use the safetensors checkpoint instead")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama GGUF tensor, or None if it has none."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        return None
    if (m := _TOP_RE.match(gguf_name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation [out, ...] (per head: interleaved pairs -> two halves).

    The converter regroups each head's rows (a0, a1, ..., b0, b1, ...) as (a0, b0, a1, b1, ...) for
    llama.cpp's interleaved rope; Hugging Face's rotate_half wants the halves back.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_tensors(reader, path) -> list:
    """(tensor, hf_name) pairs to load; raises before anything is loaded if one cannot be."""
    plan = []
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if t.name == "rope_freqs.weight":
            raise UnsupportedError(f"{path}: tensor rope_freqs.weight (Llama-3 rope frequency factors) is not "
                                   "supported in GGUF loading; use the safetensors checkpoint instead")
        name = hf_tensor_name(t.name)
        if name is None:
            raise UnsupportedError(f"{path}: GGUF tensor {t.name!r} has no Hugging Face counterpart in a llama "
                                   "model; the file is of a variant this loader does not know")
        if type_name not in SUPPORTED_TYPES:
            raise UnsupportedError(f"{path}: tensor {t.name!r} is quantized as {type_name}, which cannot be "
                                   f"dequantized here (supported: {', '.join(SUPPORTED_TYPES)}); use a GGUF "
                                   "file of another quantization or the safetensors checkpoint")
        plan.append((t, name))
    return plan


def iter_gguf_tensors(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of the file, dequantized to ``dtype`` on ``device``.

    The bytes are copied to ``device`` as they are stored and dequantized there, so a GPU does the
    work. Values are computed in float32, then cast to ``dtype``.
    """
    reader = open_gguf(path)
    config = read_gguf_config(path)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor, name in _check_tensors(reader, path):
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        raw = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1).copy())
        weight = dequantize(raw.to(device), tensor.tensor_type.name, shape, torch.float32)
        proj = name.split(".")[-2]
        if proj in heads:
            weight = unpermute_rope_rows(weight, heads[proj])
        yield name, weight.to(dtype)


def gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer a GGUF file describes, as a ``cudaformers.tokenizer.Tokenizer``."""
    from .gguf_tokenizer import build_gguf_tokenizer

    return build_gguf_tokenizer(read_metadata(path), str(path))
