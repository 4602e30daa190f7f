"""The dense decoder behind Llama, Qwen2, Qwen3 and Mistral: their differences are config.

Qwen2 has biases on q/k/v; Qwen3 normalises q and k per head; Mistral and Qwen may use a sliding
window; embeddings may be tied. Parameter names are transformers', so checkpoints load unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers.attention import Attention
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .base import PreTrainedModel


def family_traits(config) -> dict:
    qwen2 = config.model_type == "qwen2"
    bias = bool(getattr(config, "attention_bias", False)) and config.model_type not in ("mistral", "mixtral")
    return dict(
        qkv_bias=qwen2 or bias,
        o_bias=bias and not qwen2,
        qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
    )


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, **family_traits(config))
        self.mlp = mlp if mlp is not None else GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, batch):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual

    def feed_forward(self, hidden):
        return self.mlp(hidden)


class LlamaModel(nn.Module):
    layer_class = DecoderLayer

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """input_ids, positions ``[T]`` (a flat batch described by ``batch``) -> hidden ``[T, H]``."""
        batch.clear_memo()
        hidden = self.embed_tokens(input_ids)
        cos, sin = batch.rope if batch.rope is not None else self.rotary_emb(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                hidden, residual = checkpoint(layer, hidden, residual, cos, sin, batch, use_reentrant=False)
            else:
                hidden, residual = layer(hidden, residual, cos, sin, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(PreTrainedModel):
    base_model_class = LlamaModel

    def __init__(self, config):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
