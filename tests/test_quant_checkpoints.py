"""Pre-quantized int4 checkpoints (GPTQ, AWQ) written here in each format's public layout from a tiny
random model, loaded, and compared with transformers running the weights they stand for; their round
trips through save_pretrained, and the errors a user can meet."""

import json
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cudaformers import AutoModelForCausalLM, Int4Config
from cudaformers.errors import CheckpointError, UnsupportedError
from cudaformers.quant.linear import QuantLinear
from tests import tiny

IDS = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _round_to_nearest(w: torch.Tensor, group: int, sym: bool):
    """``[N, K]`` float -> codes ``[K, N]``, zero points and fp16-rounded scales ``[K/G, N]``, and the
    dequantized ``[N, K]`` weight they stand for: how both formats' tools lay out W.T, rounded to nearest."""
    n, k = w.shape
    wg = w.float().t().reshape(k // group, group, n)
    if sym:
        scale = wg.abs().amax(1) / 7.5
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        scale = (hi - lo) / 15
        zero = torch.round(-lo / scale)
    q = (torch.round(wg / scale[:, None]) + zero[:, None]).clamp(0, 15).reshape(k, n)
    deq = (q.reshape(k // group, group, n) - zero[:, None]) * scale.half().float()[:, None]
    return q, zero, scale.half(), deq.reshape(k, n).t()


def _int32(packed: torch.Tensor) -> torch.Tensor:
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # reinterpret the uint32 bits


def _write(src: Path, prefix: str, layers, quantization_config: dict) -> Path:
    """``src`` with every decoder projection replaced by ``layers(name, weight) -> {suffix: tensor}``."""
    out = {}
    for name, w in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            out.update({name.removesuffix(".weight") + "." + k: v for k, v in layers(name, w).items()})
        else:
            out[name] = w
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _reference_logits(src: Path, dequantized: dict) -> torch.Tensor:
    reference = tiny.hf_model(src)
    with torch.no_grad():
        for name, w in dequantized.items():
            reference.get_parameter(name).copy_(w)
        return reference(IDS).logits


# -- GPTQ ------------------------------------------------------------------------------------------
def _gptq_pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int4 values ``[R, C]`` -> int32 ``[R/8, C]``: eight consecutive rows per int32, row 8i+j at bits 4j."""
    v = values.to(torch.int64).view(values.shape[0] // 8, 8, values.shape[1])
    return _int32(sum(v[:, j] << (4 * j) for j in range(8)))


def _input_of(name: str, shared: bool) -> str:
    """Which input a projection reads: q/k/v share one, gate/up another (act-order GPTQ orders the
    features by the same Hessian for them); with ``shared`` off every projection gets its own."""
    layer, proj = name.split(".")[2], name.split(".")[-2]
    kind = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    return f"{layer}.{kind.get(proj, proj) if shared else proj}"


def write_gptq_checkpoint(src: Path, group: int, sym: bool, act_order: bool = False,
                          shared_orders: bool = True) -> tuple[Path, dict]:
    """Quantize every decoder Linear of ``src`` the GPTQ way (round to nearest) and write the GPTQ
    checkpoint layout; returns the folder and the dequantized weights it stands for. ``act_order``:
    the features quantized in a random order per input, codes stored in their own places and each
    feature's group in g_idx, as GPTQ's desc_act writes them."""
    dequantized = {}

    def layer(name, w):
        n, k = w.shape
        seed = zlib.crc32(_input_of(name, shared_orders).encode())
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
        q_perm, zero, scale, deq_perm = _round_to_nearest(w[:, perm], group, sym)
        q, g_idx, deq = torch.empty_like(q_perm), torch.empty(k, dtype=torch.int32), torch.empty_like(deq_perm)
        q[perm], g_idx[perm], deq[:, perm] = q_perm, (torch.arange(k) // group).to(torch.int32), deq_perm
        dequantized[name] = deq
        return {"qweight": _gptq_pack_rows(q), "qzeros": _gptq_pack_rows((zero - 1).t()).t(),  # stored minus one
                "scales": scale, "g_idx": g_idx}
    folder = _write(src, "cf-gptq-", layer, {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                            "desc_act": act_order, "damp_percent": 0.01, "true_sequential": True})
    return folder, dequantized


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq_checkpoint_matches_dequantized_reference(sym):
    src = tiny.checkpoint("llama_mha_untied")
    folder, dequantized = write_gptq_checkpoint(src, 32, sym)
    model = AutoModelForCausalLM.from_pretrained(folder)  # the config from config.json
    assert repr(model._quantization).startswith("GPTQ int4")
    torch.testing.assert_close(_logits(model), _reference_logits(src, dequantized), atol=1e-4, rtol=1e-4)


def test_gptq_checkpoint_without_g_idx_loads_the_same(tmp_path):
    folder, _ = write_gptq_checkpoint(tiny.checkpoint("llama_mha_untied"), 32, False)
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.endswith(".g_idx")}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path)),
                       _logits(AutoModelForCausalLM.from_pretrained(folder)))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_orders", "own_orders"])
def test_gptq_act_order_checkpoint_matches_dequantized_reference(shared, tmp_path):
    from cudaformers.quant.packing import PackedQuantLinear

    src = tiny.checkpoint("llama_mha_untied")
    folder, dequantized = write_gptq_checkpoint(src, 32, False, act_order=True, shared_orders=shared)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert repr(model._quantization).endswith("act-order")
    expected = _reference_logits(src, dequantized)
    torch.testing.assert_close(_logits(model), expected, atol=1e-4, rtol=1e-4)
    # q/k/v read x once where their orders agree; the separate projections give the same numbers.
    assert isinstance(getattr(model.model.layers[0].self_attn, "packed_qkv", None), PackedQuantLinear) == shared
    down = model.model.layers[1].mlp.down_proj
    torch.testing.assert_close(down.dequantize(torch.float32), dequantized["model.layers.1.mlp.down_proj.weight"])
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (saved["quant_method"], saved["act_order"]) == ("int4", True)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path)), _logits(model))


def test_gptq_act_order_gradients_reach_x_in_the_features_own_order():
    src = tiny.checkpoint("llama_mha_untied")
    folder, dequantized = write_gptq_checkpoint(src, 32, False, act_order=True)
    layer = AutoModelForCausalLM.from_pretrained(folder).model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer(x).square().sum().backward()
    w = dequantized["model.layers.0.mlp.down_proj.weight"]
    x2 = x.detach().clone().requires_grad_()
    (x2 @ w.t()).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)


def test_gptq_act_order_layer_requantizes_in_its_own_order():
    # What merging an adapter into the layer does: quantize_(dequantize() + delta).
    folder, _ = write_gptq_checkpoint(tiny.checkpoint("llama_mha_untied"), 32, False, act_order=True)
    layer = AutoModelForCausalLM.from_pretrained(folder).model.layers[0].mlp.down_proj
    w = layer.dequantize(torch.float32)
    layer.quantize_(w)
    assert (layer.dequantize(torch.float32) - w).norm() / w.norm() < 0.05


def test_act_order_int4_from_float_weights_is_refused():
    from cudaformers.quant.apply import quantize

    with pytest.raises(CheckpointError, match="act_order"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), quantization_config=Int4Config(
            group_size=32, act_order=True))
    with pytest.raises(UnsupportedError, match="act_order"):
        quantize(AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama")), Int4Config(act_order=True))


def test_gptq_g_idx_out_of_order_without_desc_act_and_other_formats_are_refused(tmp_path):
    folder, _ = write_gptq_checkpoint(tiny.checkpoint("llama_mha_untied"), 32, False, act_order=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="desc_act to true"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(UnsupportedError, match="checkpoint_format='marlin'"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), quantization_config={
            "quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"})


# -- AWQ -------------------------------------------------------------------------------------------
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's: nibble i of a word holds output column AWQ_PACK_ORDER[i]


def _awq_pack_columns(values: torch.Tensor) -> torch.Tensor:
    """int4 values ``[R, C]`` -> int32 ``[R, C/8]``: columns 8c .. 8c+7 in word c, interleaved."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    return _int32(sum(v[:, :, AWQ_PACK_ORDER[i]] << (4 * i) for i in range(8)))


def write_awq_checkpoint(src: Path, group: int, **config) -> tuple[Path, dict]:
    """``src`` quantized to AWQ's "gemm" layout (asymmetric, round to nearest: AWQ's activation-aware
    scaling changes the weights, not the layout), and the dequantized weights it stands for."""
    dequantized = {}

    def layer(name, w):
        q, zero, scale, dequantized[name] = _round_to_nearest(w, group, sym=False)
        return {"qweight": _awq_pack_columns(q), "qzeros": _awq_pack_columns(zero), "scales": scale}
    folder = _write(src, "cf-awq-", layer, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                           "version": "gemm", "modules_to_not_convert": None, **config})
    return folder, dequantized


def test_awq_checkpoint_matches_dequantized_reference():
    src = tiny.checkpoint("llama_mha_untied")
    folder, dequantized = write_awq_checkpoint(src, 32)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert repr(model._quantization) == "AWQ int4 checkpoint, group 32, asymmetric"
    torch.testing.assert_close(_logits(model), _reference_logits(src, dequantized), atol=1e-4, rtol=1e-4)


def test_awq_keeps_the_lm_head_float_whatever_its_config_lists():
    # AWQ configs of multimodal models list their vision tower; the lm_head stays as stored all the same.
    folder, _ = write_awq_checkpoint(tiny.checkpoint("llama_mha_untied"), 32, modules_to_not_convert=["visual"])
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert not isinstance(model.lm_head, QuantLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)


@pytest.mark.parametrize("change, message", [({"version": "gemv"}, "version='gemv'"), ({"bits": 8}, "bits=8"),
                                             ({"zero_point": False}, "zero_point=False")])
def test_awq_layouts_that_do_not_load_are_refused(change, message):
    with pytest.raises(UnsupportedError, match=message):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), quantization_config={
            "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm", **change})


def test_a_layer_missing_some_of_its_tensors_is_an_error():
    folder, _ = write_awq_checkpoint(tiny.checkpoint("llama_mha_untied"), 32)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks \['qzeros'\]"):
        AutoModelForCausalLM.from_pretrained(folder)


# -- both ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gptq_sym", "gptq_asym", "awq"])
def test_imported_checkpoints_save_as_int4_and_load_back(kind, tmp_path):
    src = tiny.checkpoint("llama_mha_untied")
    folder, _ = write_awq_checkpoint(src, 32) if kind == "awq" else write_gptq_checkpoint(src, 32, kind == "gptq_sym")
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    # The repacked tensors are cudaformers' int4 layout: saved as such, lm_head still not converted.
    assert (saved["quant_method"], saved["group_size"], saved["sym"]) == ("int4", 32, kind == "gptq_sym")
    assert saved["modules_to_not_convert"] == ["lm_head"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(_logits(again), _logits(model))
