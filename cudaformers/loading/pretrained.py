"""``from_pretrained``: config -> model skeleton on the meta device -> weights streamed straight to
their devices in the target dtype -> transforms (quantization, kernels, parallelism)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from ..config import PretrainedConfig
from ..errors import CheckpointError, UnsupportedError
from . import device_map as dm
from .safetensors import SafetensorsCheckpoint, checkpoint_files

logger = logging.getLogger("cudaformers")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# Checkpoint tensors that carry no weights (old transformers saved rotary tables).
_BENIGN_EXTRA = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "float32"
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = _DTYPES.get(str(dtype).removeprefix("torch."))
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedError(f"dtype={dtype!r} is not supported; use 'auto', 'bfloat16', 'float16' or 'float32'")
    return resolved


def _check_dtype_on_devices(dtype, placement) -> None:
    from ..device import check_dtype_supported

    for dev in {d for d in placement.values() if d.type == "cuda"}:
        check_dtype_supported(dtype, dev)


def load_pretrained(path_or_repo_id, *, model_class=None, dtype="auto", torch_dtype=None, device_map=None,
                    max_memory=None, attn_implementation=None, gguf_file=None, config=None,
                    use_kernels=False, kernel_config=None, quantization_config=None, tp_plan=None,
                    revision=None, cache_dir=None, token=None, local_files_only=False,
                    trust_remote_code=False, low_cpu_mem_usage=True, **config_overrides):
    from ..hub import resolve_folder
    from ..models.registry import model_class_for

    if trust_remote_code:
        raise UnsupportedError("trust_remote_code=True: cudaformers never runs code from a checkpoint; "
                               "supported architectures load without it")
    if torch_dtype is not None:
        if dtype != "auto":
            raise UnsupportedError("pass dtype= or torch_dtype=, not both (torch_dtype is the old name)")
        dtype = torch_dtype
    start = time.perf_counter()
    folder = resolve_folder(path_or_repo_id, gguf_file=gguf_file, revision=revision, cache_dir=cache_dir,
                            token=token, local_files_only=local_files_only)
    if config is None:
        config = PretrainedConfig.from_pretrained(folder, gguf_file=gguf_file)
    for key, value in config_overrides.items():
        if not hasattr(config, key):
            raise TypeError(f"from_pretrained got an unknown argument {key!r} (not a config field either)")
        setattr(config, key, value)
    if quantization_config is None and getattr(config, "quantization_config", None):
        quantization_config = config.quantization_config  # a saved quantized checkpoint
    cls = model_class or model_class_for(config)
    dtype = resolve_dtype(dtype, config) if not gguf_file or dtype != "auto" else torch.float32
    config.torch_dtype = str(dtype).removeprefix("torch.")

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    fp8_blocks = None  # a block-scaled fp8 checkpoint's weight_block_size: its weights load through floats
    if quantization_config is not None:
        from ..quant.apply import prepare_model_for_quantization
        from ..quant.config import fp8_block_size, quantization_config_from, with_checkpoint_blocks

        stored = getattr(config, "quantization_config", None)
        quantization_config = with_checkpoint_blocks(quantization_config_from(quantization_config), stored)
        # Any method can quantize the floats the blocks stand for (e.g. Int4Config of an fp8 release).
        fp8_blocks = fp8_block_size(stored) or getattr(quantization_config, "weight_block_size", None)
        if getattr(quantization_config, "dequantize", False):
            if not fp8_blocks:
                raise UnsupportedError("FP8Config(dequantize=True) loads a block-scaled fp8 checkpoint (one with "
                                       "weight_block_size in its config.json) in the model's dtype; this checkpoint "
                                       "is not one. Load it without quantization_config, or with FP8Config()")
            config.__dict__.pop("quantization_config", None)  # the model holds floats: nothing quantized to record
        else:
            prepare_model_for_quantization(model, quantization_config)
    if tp_plan is not None and device_map is None:
        from ..distributed.init import local_device

        # Under torchrun each process loads the whole model onto its own GPU, then keeps its share.
        device_map = str(local_device())
    placement = dm.plan(model, device_map, dtype, max_memory)
    _check_dtype_on_devices(dtype, placement)
    _materialize(model, placement)
    tensors = _gguf_tensors(folder / gguf_file, dtype) if gguf_file else SafetensorsCheckpoint(checkpoint_files(folder))
    _load_tensors(model, tensors, fp8_blocks)
    model.tie_weights()
    from ..kernels.fused_projections import fuse_projections

    fuse_projections(model)  # fewer, larger matmuls in inference; names and training unaffected
    dm.install_device_hooks(model, placement)
    model.hf_device_map = {k: str(v) for k, v in placement.items()}
    model.name_or_path = str(path_or_repo_id)
    model._choices["loaded"] = f"{folder}{'/' + gguf_file if gguf_file else ''} in {time.perf_counter() - start:.2f}s"

    from ..generation.config import GenerationConfig

    model.generation_config = GenerationConfig.from_model_folder(folder, config)
    model.eval()
    model.set_attn_implementation(attn_implementation or "sdpa")
    if use_kernels or kernel_config is not None:
        from ..kernels.hub import kernelize

        kernelize(model, kernel_config=kernel_config)
    if tp_plan is not None:
        from ..distributed.tp import apply_tp_plan

        apply_tp_plan(model, tp_plan)
    return model


def _materialize(model, placement) -> None:
    """Give every meta parameter and buffer real (uninitialised) storage on its device. A module the
    placement does not name (by unit, "auto" names no parameter-free module such as the rotary
    embedding) goes where the forward starts, with the embeddings."""
    first = dm.device_of("model.embed_tokens", placement) or next(iter(placement.values()))
    for name, module in model.named_modules():
        module.to_empty(device=dm.device_of(name, placement) or first, recurse=False)
    for module in model.modules():
        if hasattr(module, "reset_parameters") and not list(module.parameters(recurse=False)) \
                and list(module.buffers(recurse=False)):
            module.reset_parameters()  # buffers computed from the config (rotary frequencies)


def _gguf_tensors(path: Path, dtype):
    from .gguf import iter_gguf_tensors

    for name, tensor in iter_gguf_tensors(path, dtype=dtype, device="cpu"):
        yield name, tensor, path


def _stream_target(params) -> torch.device | None:
    """The GPU a safetensors checkpoint streams to: the one CUDA device holding every parameter.
    Models on the CPU, across devices or offloaded read the memory-mapped files in place.
    Streaming is the default (measured on an H200: a 16.4 GB qwen3-8b checkpoint in 1.34 s, against
    3.40 s tensor by tensor and 3.23 s for transformers, identical weights); CUDAFORMERS_STREAM_LOAD=0
    copies tensor by tensor from the mapped files instead."""
    devices = {p.device for p in params.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    if os.environ.get("CUDAFORMERS_STREAM_LOAD", "1") == "0":
        return None
    return next(iter(devices))


def _load_tensors(model, tensors, fp8_blocks=None) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    target = _stream_target(params) if isinstance(tensors, SafetensorsCheckpoint) else None
    read = tensors.stream(target) if target is not None else iter(tensors)
    source = read
    if fp8_blocks:
        from ..quant.fp8_blocks import dequantized_stream

        source = dequantized_stream(read, tuple(fp8_blocks))
    start = time.perf_counter()
    try:
        nbytes = _assign(model, params, modules, source, streamed=target is not None)
    finally:
        if hasattr(read, "close"):
            read.close()  # a streamed source stops its reader threads, also when loading fails
    for dev in {p.device for p in params.values() if p.device.type == "cuda"}:
        torch.cuda.synchronize(dev)
    if target is not None and target.type == "cuda":
        torch.cuda.empty_cache()  # the staging buffers, so that free memory reads true after loading
    seconds = max(time.perf_counter() - start, 1e-9)
    how = f"streamed to {target} through pinned buffers" if target is not None else "read in place"
    model._choices["weights"] = f"{nbytes / 1e9:.2f} GB in {seconds:.2f}s ({nbytes / 1e9 / seconds:.1f} GB/s, {how})"
    logger.info("loaded weights: %s", model._choices["weights"])


def _assign(model, params, modules, tensors, streamed: bool) -> int:
    """Every checkpoint tensor to its parameter or its module's loader; returns the bytes read."""
    loaded, via_loader, unexpected, nbytes = set(), set(), [], 0
    for name, tensor, file in tensors:
        nbytes += tensor.nbytes
        module_name, _, attr = name.rpartition(".")
        module = modules.get(module_name)
        # A tensor below a module that loads its whole subtree (stacked MoE experts reading
        # per-expert tensors) goes to that module with the rest of its name.
        while module is None and "." in module_name:
            module_name, _, head = module_name.rpartition(".")
            attr = f"{head}.{attr}"
            module = modules.get(module_name)
        loader = getattr(module, "load_checkpoint_tensor", None)
        if loader is not None:  # layers that pack/quantize their weights load them themselves
            # A streamed tensor views a staging buffer that is reused; loaders may keep what they get.
            loader(attr, tensor.clone() if streamed else tensor)
            via_loader.add(module_name)
            continue
        param = params.get(name)
        if param is None:
            if not name.endswith(_BENIGN_EXTRA):
                unexpected.append(name)
            continue
        if tuple(param.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)} but the model built "
                                  f"from config.json expects {tuple(param.shape)}; config.json does not match "
                                  "the weights (wrong checkpoint or edited config)")
        with torch.no_grad():
            param.copy_(tensor, non_blocking=True)
        loaded.add(name)
    for module_name in via_loader:  # a layer read from several tensors checks that all of them came
        finish = getattr(modules[module_name], "finish_checkpoint", None)
        if finish is not None:
            finish()
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")
               and n.rpartition(".")[0] not in via_loader]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} weights the model needs, e.g. {missing[:4]}; "
                              "the files are incomplete or belong to another architecture")
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use, e.g. %s", len(unexpected),
                       unexpected[:4])
    return nbytes
