"""Qwen3-MoE: the Qwen3 decoder (q/k norms, GQA) with a sparse MoE block in place of the MLP.

Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP.
Routing: softmax over the experts, top-k, renormalised when ``norm_topk_prob``, weights rounded to
the activation dtype, as transformers does.
"""

from __future__ import annotations

from ..layers.moe import SparseMoeBlock, per_expert_state_dict
from .llama import DecoderLayer, LlamaForCausalLM, LlamaModel


def num_experts(config) -> int:
    # Hub configs say num_experts; transformers >= 5.2x writes num_local_experts.
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def is_sparse_layer(config, layer_idx: int) -> bool:
    experts = num_experts(config)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and experts > 0 \
        and (layer_idx + 1) % step == 0


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = None
        if is_sparse_layer(config, layer_idx):
            mlp = SparseMoeBlock(config, num_experts(config), config.moe_intermediate_size,
                                 renormalize=bool(getattr(config, "norm_topk_prob", False)),
                                 weights_in_hidden_dtype=True)
        super().__init__(config, layer_idx, mlp=mlp)


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    base_model_class = Qwen3MoeModel

    def checkpoint_state_dict(self) -> dict:
        return per_expert_state_dict(self)
