"""Mixtral: the Mistral decoder with a sparse MoE block (``block_sparse_moe``) of 8-ish experts.

Parameter names follow the checkpoints: ``block_sparse_moe.gate`` is the router, experts are
``w1`` (gate), ``w3`` (up) and ``w2`` (down) on disk, held stacked in memory. Routing always
renormalises the top-k softmax weights and keeps them in fp32.
"""

from __future__ import annotations

from ..errors import UnsupportedError
from ..layers.moe import SparseMoeBlock, per_expert_state_dict
from .llama import DecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        block = SparseMoeBlock(config, config.num_local_experts, config.intermediate_size, renormalize=True,
                               weights_in_hidden_dtype=False, expert_names=("w1", "w3", "w2"))
        super().__init__(config, layer_idx, mlp=block)
        self.block_sparse_moe = self._modules.pop("mlp")  # the checkpoints' name for the block
        self.jitter_noise = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)

    def feed_forward(self, hidden):
        if self.training and self.jitter_noise > 0:
            raise UnsupportedError("router_jitter_noise > 0 (random router input noise in training) is not "
                                   "supported; set config.router_jitter_noise = 0")
        return self.block_sparse_moe(hidden)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    base_model_class = MixtralModel

    def checkpoint_state_dict(self) -> dict:
        return per_expert_state_dict(self)
