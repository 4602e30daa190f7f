"""What every causal LM shares: the transformers-style call, attention selection, loading, saving
and generation entry points. Families only build their modules."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..attention import registry as attention_registry
from ..attention.metadata import AttentionBatch
from ..layers.attention import Attention
from ..layers.loss import IGNORE_INDEX, cross_entropy_from_logits, shift_labels_flat
from . import structure
from .outputs import CausalLMOutput

logger = logging.getLogger("cudaformers")


class PreTrainedModel(nn.Module):
    base_model_class: type = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.generation_config = None
        # A callable (hidden [N, H], lm_head weight, targets [N], num_items) -> loss that never builds
        # the full logits; installed from outside (kernels), None for the plain path.
        self.fused_loss = None
        self._choices: dict[str, object] = {}  # name -> text, or a function giving it

    def _apply(self, fn, recurse=True):
        # .to() / .half() / .cuda() move every tensor on its own: packed projections are released
        # before and stacked again after (kernels/fused_projections.py).
        from ..kernels.fused_projections import relink_projections, release_packed
        from ..kernels.hub import follow_device

        released, moved = release_packed(self), False
        try:
            out = super()._apply(fn, recurse)
            moved = True
        finally:  # also after a failed move: the model stays usable, unpacked where it must be
            relink_projections(self, released, fn if moved else None)
        # Decode runners hold KV caches and CUDA graphs of the tensors as they were: made again on demand.
        self.__dict__.pop("_decode_runners", None)
        self.__dict__.pop("_graph_plan", None)  # where the parameters sit decides whether graphs are used
        follow_device(self)
        return out

    # -- properties users expect ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def num_parameters(self, only_trainable: bool = False) -> int:
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) in seen or (only_trainable and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- attention backend ------------------------------------------------------------------------
    def attention_layers(self):
        return [m for m in self.modules() if isinstance(m, Attention)]

    def graph_blockers(self) -> list[str]:
        """Why this model's forward cannot be captured in a CUDA graph (empty: it can). A module
        class declares ``graph_safe = False`` when its plain forward reads the device from the host;
        a kernel bound onto the instance (use_kernels) lifts that."""
        reasons = {f"attention backend {layer.backend.name!r}" for layer in self.attention_layers()
                   if not getattr(layer.backend, "graph_safe", False)}
        reasons |= {f"{type(m).__name__} without use_kernels=True" for m in self.modules()
                    if getattr(type(m), "graph_safe", True) is False and "forward" not in vars(m)}
        return sorted(reasons)

    def set_attn_implementation(self, name: str = "sdpa") -> None:
        layers = self.attention_layers()
        windows = any(layer.sliding_window for layer in layers)
        backend = attention_registry.get_backend(
            name, device=self.device, dtype=self.dtype, head_dim=self.config.head_dim,
            sliding_window=windows, training=self.training)
        if any(getattr(layer, "backend", None) is not backend for layer in layers):
            structure.changed()  # captured graphs replay the old backend
        for layer in layers:
            layer.backend = backend
        self.config._attn_implementation = name
        chosen = backend.name if backend.name == name else f"{backend.name} (for {name!r})"
        self._choices["attention"] = chosen

    def train(self, mode: bool = True):
        super().train(mode)
        name = getattr(self.config, "_attn_implementation", None)
        if mode and name and self.attention_layers():
            self.set_attn_implementation(name)  # re-checks that the backend has a backward
        for hook in getattr(self, "_mode_hooks", []):
            hook(self, mode)
        return self

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    def explain(self) -> str:
        """The automatic and requested choices that shape how this model runs."""
        devices = sorted({str(p.device) for p in self.parameters()})
        lines = [f"{type(self).__name__} ({self.config.model_type}), {self.num_parameters() / 1e6:.1f}M parameters",
                 f"  dtype: {str(self.dtype).removeprefix('torch.')}; devices: {', '.join(devices)}"]
        # A value may be a function: what it describes can change after loading (module switches).
        lines += [f"  {k}: {v() if callable(v) else v}" for k, v in self._choices.items()]
        return "\n".join(lines)

    # -- forward ----------------------------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids=None, attention_mask=None, labels=None, *, positions=None, batch=None,
                position_ids=None, logits_to_keep: int = 0, num_items_in_batch=None, **unused):
        unused.pop("use_cache", None)
        unused.pop("return_dict", None)
        if unused:
            raise TypeError(f"{type(self).__name__}.forward got unsupported arguments {sorted(unused)}")
        if batch is not None:
            return self._forward_flat(input_ids, positions, batch, labels, num_items_in_batch)
        return self._forward_padded(input_ids, attention_mask, position_ids, labels, logits_to_keep,
                                    num_items_in_batch)

    def _loss_and_logits(self, hidden, targets, num_items_in_batch, want_logits=True):
        if targets is not None and self.fused_loss is not None and self.training:
            return self.fused_loss(hidden, self.lm_head.weight, targets, num_items_in_batch), None
        logits = self.compute_logits(hidden)
        loss = None if targets is None else cross_entropy_from_logits(logits, targets, num_items_in_batch)
        return loss, logits

    def _forward_flat(self, input_ids, positions, batch: AttentionBatch, labels, num_items_in_batch):
        """input_ids/positions/labels ``[T]``: packed sequences, no padding (training, engine)."""
        hidden = self.model(input_ids, positions, batch)
        targets = None if labels is None else shift_labels_flat(labels, batch.cu_seqlens_q)
        loss, logits = self._loss_and_logits(hidden, targets, num_items_in_batch)
        return CausalLMOutput(loss=loss, logits=logits)

    def _forward_padded(self, input_ids, attention_mask, position_ids, labels, logits_to_keep, num_items_in_batch):
        """The transformers call: ``[B, S]`` inputs, padded positions masked out by attention_mask.

        Padding is removed before the model runs (varlen attention), so each row is computed as if
        alone; positions count real tokens (as generate() does), and pad positions get zero logits.
        """
        b, s = input_ids.shape
        if attention_mask is None:
            mask = None
            flat_ids = input_ids.reshape(-1)
            lengths = [s] * b
            positions = (position_ids if position_ids is not None
                         else torch.arange(s, device=input_ids.device).expand(b, s)).reshape(-1)
        else:
            mask = attention_mask.to(input_ids.device).bool()
            flat_ids = input_ids[mask]
            lengths = mask.sum(1).tolist()
            positions = (position_ids if position_ids is not None else mask.long().cumsum(1) - 1)[mask]
        batch = AttentionBatch.from_seqlens(lengths, input_ids.device)
        hidden = self.model(flat_ids, positions, batch)
        targets = None
        if labels is not None:
            shifted = torch.full_like(labels, IGNORE_INDEX)
            shifted[:, :-1] = labels[:, 1:]
            targets = shifted.reshape(-1) if mask is None else shifted[mask]
        if logits_to_keep and targets is None:
            keep = torch.zeros(b, s, dtype=torch.bool, device=input_ids.device)
            keep[:, -logits_to_keep:] = True
            sel = keep.reshape(-1) if mask is None else keep[mask]
            logits = self.compute_logits(hidden[sel])
            out = logits.new_zeros(b, s, logits.shape[-1])
            full = keep if mask is None else keep & mask
            out[full] = logits
            return CausalLMOutput(logits=out[:, -logits_to_keep:])
        loss, logits = self._loss_and_logits(hidden, targets, num_items_in_batch)
        if logits is not None:
            if mask is None:
                logits = logits.view(b, s, -1)
            else:
                padded = logits.new_zeros(b, s, logits.shape[-1])
                padded[mask] = logits
                logits = padded
        return CausalLMOutput(loss=loss, logits=logits)

    # -- loading, saving, generating (implemented in their own modules) ---------------------------
    @classmethod
    def from_pretrained(cls, path_or_repo_id, **kwargs):
        from ..loading.pretrained import load_pretrained

        return load_pretrained(path_or_repo_id, model_class=None if cls is PreTrainedModel else cls, **kwargs)

    def save_pretrained(self, folder, max_shard_size: int | str = "5GB", safe_serialization: bool = True, **kw):
        from ..loading.save import save_pretrained

        save_pretrained(self, folder, max_shard_size=max_shard_size, safe_serialization=safe_serialization, **kw)

    @torch.inference_mode()
    def generate(self, input_ids=None, attention_mask=None, generation_config=None, streamer=None, **kwargs):
        from ..generation.generate import generate

        return generate(self, input_ids, attention_mask=attention_mask, generation_config=generation_config,
                        streamer=streamer, **kwargs)

    def generate_batch(self, inputs, generation_config=None, **kwargs):
        from ..engine.continuous_batching import generate_batch

        return generate_batch(self, inputs, generation_config=generation_config, **kwargs)

    def init_continuous_batching(self, generation_config=None, **kwargs):
        from ..engine.continuous_batching import init_continuous_batching

        return init_continuous_batching(self, generation_config=generation_config, **kwargs)
