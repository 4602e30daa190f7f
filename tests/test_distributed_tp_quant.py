"""Tensor parallelism of quantized models: each layer's shards against the whole layer, and the split
model on 2 CPU processes (gloo) against the single-process one."""

import copy

import pytest
import torch

from cudaformers import AutoModelForCausalLM, BitsAndBytesConfig, Int4Config, Int8Config
from cudaformers.distributed import tp_quant
from cudaformers.errors import UnsupportedError
from cudaformers.quant.int4 import Int4Linear
from cudaformers.quant.linear import QuantLinear
from cudaformers.quant.int8 import Int8Linear
from cudaformers.quant.nf4 import NF4Linear
from test_train_toy import run_processes

METHODS = {
    "int8": Int8Config(),
    "int4": Int4Config(group_size=16),
    "int4_asym": Int4Config(group_size=16, sym=False),
    "nf4_dq": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.float32),
    "fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    # o_proj stays float: DTensor shards it, the quantized layers around it are split by hand
    "int8_float_o": Int8Config(modules_to_not_convert=["lm_head", "o_proj"]),
}


# The layers of each method, built directly: (class, its settings past in/out/bias/dtype)
LAYERS = {
    "int8": (Int8Linear, {}),
    "int4": (Int4Linear, {"group_size": 16}),
    "int4_asym": (Int4Linear, {"group_size": 16, "sym": False}),
    "nf4_dq": (NF4Linear, {"quant_type": "nf4", "double_quant": True}),
    "fp4": (NF4Linear, {"quant_type": "fp4"}),
}


def _layer(name, n=96, k=256):
    cls, settings = LAYERS[name]
    gen = torch.Generator().manual_seed(0)
    layer = cls(k, n, True, torch.float32, **settings)
    with torch.no_grad():
        layer.quantize_(torch.randn(n, k, generator=gen))
        layer.bias.copy_(torch.randn(n, generator=gen))
    return layer


@pytest.mark.parametrize("name", list(LAYERS))
def test_shards_are_exactly_slices_of_the_quantized_weight(name):
    whole = _layer(name)
    w = whole.dequantize(torch.float32)
    x = torch.randn(3, whole.in_features, generator=torch.Generator().manual_seed(1))
    partial = torch.zeros(3, whole.out_features)
    for rank in range(2):
        col = copy.deepcopy(whole)
        tp_quant.shard_quantized(col, "colwise", rank, 2, None)
        assert col.out_features == 48 and col.in_features == 256
        torch.testing.assert_close(col.dequantize(torch.float32), w[rank * 48:(rank + 1) * 48], rtol=0, atol=0)
        torch.testing.assert_close(col.bias, whole.bias[rank * 48:(rank + 1) * 48], rtol=0, atol=0)
        row = copy.deepcopy(whole)
        tp_quant.shard_quantized(row, "rowwise", rank, 2, None)
        assert row.in_features == 128 and isinstance(row, type(whole))
        torch.testing.assert_close(row.dequantize(torch.float32), w[:, rank * 128:(rank + 1) * 128], rtol=0, atol=0)
        # this shard's partial product: the layer's own matmul, before the sum across processes
        partial += type(whole).matmul(row, x[:, rank * 128:(rank + 1) * 128].to(row.compute_dtype)).float()
    torch.testing.assert_close(partial + whole.bias.float(), x @ w.T + whole.bias.float(), rtol=1e-4, atol=1e-3)


def test_shards_that_would_cut_a_packing_block_are_refused():
    layer = _layer("int4", k=96)  # groups of 16: 96 / 4 = 24 features a shard, not whole groups
    with pytest.raises(UnsupportedError, match="whole blocks of 16.*multiple of 16"):
        tp_quant.shard_quantized(layer, "rowwise", 0, 4, None, "layers.0.mlp.down_proj")
    with pytest.raises(UnsupportedError, match="5 processes do not divide the 96 output rows"):
        tp_quant.shard_quantized(_layer("int8"), "colwise", 0, 5, None)
    act_order = _layer("int4")
    act_order.act_order = True
    with pytest.raises(UnsupportedError, match="act-order.*device_map"):
        tp_quant.shard_quantized(act_order, "rowwise", 0, 2, None)


def quantized_outputs(ids, methods):
    import tiny

    out = {}
    for name in methods:
        model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32,
                                                     quantization_config=METHODS[name], tp_plan="auto")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ids)).logits
        tokens = model.generate(torch.tensor(ids[:1]), max_new_tokens=6, do_sample=False, eos_token_id=None)
        o_proj = model.model.layers[0].self_attn.o_proj
        w = o_proj.weight
        o_in = o_proj.in_features if isinstance(o_proj, QuantLinear) else getattr(w, "to_local", lambda: w)().shape[1]
        out[name] = {"logits": logits.tolist(), "tokens": tokens.tolist(), "tp_size": getattr(model, "tp_size", 1),
                     "o_in": o_in, "packed": hasattr(model.model.layers[0].mlp, "packed_gate_up")}
    return out


def test_tensor_parallel_quantized_models_match_single_process(tmp_path):
    ids = [[5, 9, 33, 100, 7, 2, 11], [1, 2, 3, 4, 5, 6, 7]]
    want = quantized_outputs(ids, list(METHODS))
    for got in run_processes(quantized_outputs, 2, tmp_path, ids=ids, methods=list(METHODS)):
        for name, r in got.items():
            assert r["tp_size"] == 2 and r["o_in"] == 64, name  # o_proj holds half of its 128 inputs
            assert r["packed"], name  # each process's gate/up shards pack again (the split undid NF4's double quant)
            torch.testing.assert_close(torch.tensor(r["logits"]), torch.tensor(want[name]["logits"]),
                                       rtol=1e-4, atol=1e-4, msg=name)
            assert r["tokens"] == want[name]["tokens"], name


def lora_on_tp(ids):
    import tiny
    from cudaformers.distributed.init import init_distributed
    from cudaformers.distributed.tp import apply_tp
    from cudaformers import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32,
                                                 quantization_config=METHODS["int8"])
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    state = init_distributed()
    try:
        apply_tp(peft, init_device_mesh("cpu", (state.world_size,)))
    except UnsupportedError as e:
        return {"error": str(e)}
    return {"error": None}


def test_adapters_on_a_tensor_parallel_model_are_refused(tmp_path):
    for r in run_processes(lora_on_tp, 2, tmp_path, ids=[[1, 2]]):
        assert r["error"] and "LoRA adapters" in r["error"] and "DDP or FSDP" in r["error"]
