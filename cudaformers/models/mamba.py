"""Mamba (``MambaForCausalLM``): a stack of selective state-space mixers, no attention.

Parameter names are transformers' (``backbone.layers.{i}.mixer.in_proj`` ...). Instead of a KV cache a
sequence carries a fixed-size state per layer: the last ``K - 1`` conv inputs and the ``[I, N]`` SSM
state, so decoding costs the same at every position. ``generate`` is the model's own: prompts are
prefilled one row at a time (each row exactly as if alone, no padding), then all rows decode together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnsupportedError
from ..kernels.mamba import causal_conv1d_reference, selective_scan_reference
from ..layers.activation import activation
from ..layers.loss import IGNORE_INDEX, cross_entropy_from_logits
from ..layers.norm import RMSNorm
from .base import PreTrainedModel
from .outputs import CausalLMOutput


@dataclass
class MambaState:
    conv: list  # per layer [B, I, K-1]
    ssm: list   # per layer [B, I, N] fp32

    @staticmethod
    def cat(states: list["MambaState"]) -> "MambaState":
        return MambaState([torch.cat(c) for c in zip(*(s.conv for s in states))],
                          [torch.cat(h) for h in zip(*(s.ssm for s in states))])


class CausalConv1d(nn.Conv1d):
    """Depthwise causal conv over ``[B, C, L]`` continuing from a state; ``nn.Conv1d`` for its names."""

    kernel_layer_name = "causal_conv1d_fn"

    def __init__(self, channels: int, kernel: int, bias: bool, act: str):
        super().__init__(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=bias)
        self.fuse_silu = act in ("silu", "swish")
        self.act = activation(act)

    def forward(self, x, state=None):
        y, state = causal_conv1d_reference(x, self.weight[:, 0], self.bias, state, silu=self.fuse_silu)
        return (y if self.fuse_silu else self.act(y)), state


class SelectiveScan(nn.Module):
    """The scan as a module so a kernel can be swapped in; see ``selective_scan_reference``."""

    kernel_layer_name = "selective_scan_fn"

    def forward(self, u, delta, A, B, C, D=None, z=None, delta_bias=None, state=None):
        return selective_scan_reference(u, delta, A, B, C, D, z, delta_bias, state)


class MambaMixer(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i, n = config.hidden_size, config.intermediate_size, config.state_size
        self.rank = config.time_step_rank
        self.state_size = n
        self.in_proj = nn.Linear(h, 2 * i, bias=config.use_bias)
        self.conv1d = CausalConv1d(i, config.conv_kernel, config.use_conv_bias, config.hidden_act)
        self.x_proj = nn.Linear(i, self.rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(self.rank, i, bias=True)
        self.A_log = nn.Parameter(torch.empty(i, n))
        self.D = nn.Parameter(torch.empty(i))
        self.out_proj = nn.Linear(i, h, bias=config.use_bias)
        self.scan = SelectiveScan()

    def forward(self, x, conv_state=None, ssm_state=None):
        """x ``[B, L, H]`` -> (``[B, L, H]``, conv state, ssm state)."""
        dtype = x.dtype
        u, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)          # [B, I, L] each
        u, conv_state = self.conv1d(u, conv_state)
        dt, B, C = torch.split(self.x_proj(u.transpose(1, 2)), [self.rank, self.state_size, self.state_size], -1)
        dt = self.dt_proj.weight @ dt.transpose(1, 2)                     # [B, I, L], bias added in the scan
        A = -torch.exp(self.A_log.float())
        y, ssm_state = self.scan(u, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), z,
                                 self.dt_proj.bias.float(), ssm_state)
        return self.out_proj(y.transpose(1, 2).to(dtype)), conv_state, ssm_state


class MambaBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = MambaMixer(config)
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, hidden, conv_state=None, ssm_state=None):
        residual = hidden.float() if self.residual_in_fp32 else hidden
        out, conv_state, ssm_state = self.mixer(self.norm(hidden.to(self.norm.weight.dtype)), conv_state, ssm_state)
        return residual + out, conv_state, ssm_state


class MambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, state: MambaState | None = None):
        """input_ids ``[B, L]`` -> (hidden ``[B, L, H]``, state after the last token)."""
        hidden = self.embeddings(input_ids)
        conv, ssm = [], []
        for i, layer in enumerate(self.layers):
            hidden, c, s = layer(hidden, state.conv[i] if state else None, state.ssm[i] if state else None)
            conv.append(c)
            ssm.append(s)
        return self.norm_f(hidden.to(self.norm_f.weight.dtype)), MambaState(conv, ssm)


def _fill_config_defaults(config) -> None:
    defaults = dict(state_size=16, conv_kernel=4, expand=2, use_bias=False, use_conv_bias=True, hidden_act="silu",
                    layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=True, time_step_rank="auto")
    for key, value in defaults.items():
        if getattr(config, key, None) is None:
            setattr(config, key, value)
    if getattr(config, "intermediate_size", None) is None:
        config.intermediate_size = config.expand * config.hidden_size
    if config.time_step_rank == "auto":
        config.time_step_rank = math.ceil(config.hidden_size / 16)


class MambaForCausalLM(PreTrainedModel):
    def __init__(self, config):
        _fill_config_defaults(config)
        super().__init__(config)
        self.backbone = MambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @property
    def device(self) -> torch.device:
        return self.backbone.embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embeddings.weight.dtype

    def get_input_embeddings(self):
        return self.backbone.embeddings

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", True):
            self.lm_head.weight = self.backbone.embeddings.weight

    def set_attn_implementation(self, name: str = "sdpa") -> None:
        if name not in (None, "sdpa", "eager"):
            raise UnsupportedError(f"attn_implementation={name!r}: Mamba has no attention layers; leave it unset")
        self._choices["attention"] = "none (state-space model)"

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        raise UnsupportedError("gradient checkpointing is not implemented for Mamba; train without it")

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **unused):
        unused.pop("use_cache", None)
        unused.pop("return_dict", None)
        if unused:
            raise TypeError(f"MambaForCausalLM.forward got unsupported arguments {sorted(unused)}")
        b, s = input_ids.shape
        mask = None if attention_mask is None else attention_mask.to(input_ids.device).bool()
        if mask is None or bool(mask.all()):
            hidden = self.backbone(input_ids)[0].reshape(b * s, -1)
            sel = None
        else:  # each row runs on its real tokens alone: padding never enters the recurrent state
            sel = mask.reshape(-1)
            hidden = torch.cat([self.backbone(row[m][None])[0][0] for row, m in zip(input_ids, mask)])
        targets = None
        if labels is not None:
            shifted = torch.full_like(labels, IGNORE_INDEX)
            shifted[:, :-1] = labels[:, 1:]
            targets = shifted.reshape(-1) if sel is None else shifted.reshape(-1)[sel]
        if targets is not None and self.fused_loss is not None and self.training:
            return CausalLMOutput(loss=self.fused_loss(hidden, self.lm_head.weight, targets, num_items_in_batch))
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        loss = None if targets is None else cross_entropy_from_logits(logits, targets, num_items_in_batch)
        if sel is not None:
            full = logits.new_zeros(b * s, logits.shape[-1])
            full[sel] = logits
            logits = full
        return CausalLMOutput(loss=loss, logits=logits.view(b, s, -1))

    @torch.inference_mode()
    def generate(self, input_ids=None, attention_mask=None, generation_config=None, streamer=None, **kwargs):
        return generate_recurrent(self, input_ids, attention_mask, generation_config, streamer, **kwargs)

    def prefill(self, rows: list[torch.Tensor]):
        """Prompts (1-D token tensors) -> (last-token logits ``[B, V]``, batched state)."""
        logits, states = [], []
        for row in rows:
            hidden, state = self.backbone(row[None])
            logits.append(self.lm_head(hidden[:, -1].to(self.lm_head.weight.dtype)))
            states.append(state)
        return torch.cat(logits), MambaState.cat(states)

    def decode(self, tokens: torch.Tensor, state: MambaState):
        """One token per row ``[B]`` -> (logits ``[B, V]``, next state)."""
        hidden, state = self.backbone(tokens[:, None], state)
        return self.lm_head(hidden[:, -1].to(self.lm_head.weight.dtype)), state


def generate_recurrent(model, input_ids, attention_mask=None, generation_config=None, streamer=None, **kwargs):
    """``generate()`` for recurrent models (``model.prefill`` / ``model.decode``): same arguments,
    left-padding handling, sampling and stop rules as the attention models' generate()."""
    from ..generation.generate import decode_loop, prepare_prompts, resolve_config, sampling_state

    gen = resolve_config(model, generation_config, kwargs)
    if input_ids is None:
        raise ValueError("generate() needs input_ids (tokenize the prompt first)")
    if gen.stop_strings:
        raise UnsupportedError("stop_strings are not supported for Mamba models yet; use eos_token_id")
    if gen.num_return_sequences != 1:
        raise UnsupportedError("num_return_sequences > 1 is not supported for Mamba models yet")
    input_ids, rows, pad, eos_ids, max_new = prepare_prompts(model, input_ids, attention_mask, gen, streamer)
    if max_new <= 0:
        return input_ids
    st, seen, generator, eos = sampling_state(model, gen, rows, eos_ids)
    logits, state = model.prefill(rows)

    def step(tokens):
        nonlocal state
        next_logits, state = model.decode(tokens, state)
        return next_logits

    generated = decode_loop(logits, step, gen, st, seen, generator, eos, pad, max_new, input_ids, streamer)
    return torch.cat([input_ids, generated], dim=1)
