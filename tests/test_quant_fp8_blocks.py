"""Block-scaled fp8 checkpoints (weight_block_size), written here in that layout from a tiny random
model: the block dequantization against a plain loop, the model loaded in its dtype
(``FP8Config(dequantize=True)``) against transformers running the weights the blocks stand for, and
the errors a user can meet. The fp8 kernels' side (re-quantized per channel) is a GPU test."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cudaformers import AutoModelForCausalLM, FP8Config, Int4Config
from cudaformers.errors import CheckpointError, UnsupportedError
from cudaformers.quant.fp8_blocks import dequantize_blocks
from cudaformers.quant.linear import QuantLinear
from tests import tiny

IDS = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))


def _blocks_reference(weight, scale_inv, block):
    out = torch.empty(weight.shape)
    for i in range(weight.shape[0]):
        for j in range(weight.shape[1]):
            out[i, j] = weight[i, j].float() * scale_inv[i // block[0], j // block[1]]
    return out


@pytest.mark.parametrize("shape, block", [((13, 20), (4, 8)), ((16, 32), (16, 32)), ((17, 9), (16, 16))])
def test_dequantize_blocks_matches_a_loop(shape, block):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1]), generator=g)
    assert torch.equal(dequantize_blocks(weight, scale_inv, block), _blocks_reference(weight, scale_inv, block))
    with pytest.raises(CheckpointError, match="weight_block_size"):
        dequantize_blocks(weight, torch.ones(5, 5), block)


def write_fp8_block_checkpoint(src: Path, block=(16, 32)) -> tuple[Path, dict]:
    """Every decoder projection of ``src`` as e4m3 with a multiplier per block (largest value of a
    block -> 448, as the public fp8 releases are made), and the float weights they stand for."""
    out, dequantized = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            out[name] = w
            continue
        n, k = w.shape
        blocks = w.float().view(n // block[0], block[0], k // block[1], block[1])
        scale_inv = blocks.abs().amax((1, 3)) / 448.0
        q = (blocks / scale_inv[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
        out[name], out[name + "_scale_inv"] = q, scale_inv
        dequantized[name] = _blocks_reference(q, scale_inv, block)
    folder = Path(tempfile.mkdtemp(prefix="cf-fp8-blocks-"))
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, dequantized


@pytest.fixture(scope="module")
def checkpoint():
    src = tiny.checkpoint("llama_mha_untied")
    folder, dequantized = write_fp8_block_checkpoint(src)
    reference = tiny.hf_model(src)
    with torch.no_grad():
        for name, w in dequantized.items():
            reference.get_parameter(name).copy_(w)
        expected = reference(IDS).logits
    return folder, expected


def test_dequantized_load_matches_the_weights_the_blocks_stand_for(checkpoint, tmp_path):
    folder, expected = checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=FP8Config(dequantize=True))
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with torch.no_grad():
        got = model(IDS).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # It holds floats: saved, it is a plain checkpoint.
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)(IDS).logits, got)


def test_other_methods_quantize_the_weights_the_blocks_stand_for(checkpoint, tmp_path):
    folder, _ = checkpoint
    floats = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  quantization_config=FP8Config(dequantize=True))
    floats.save_pretrained(tmp_path)
    direct = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=Int4Config(group_size=32))
    via_floats = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                      quantization_config=Int4Config(group_size=32))
    with torch.no_grad():
        assert torch.equal(direct(IDS).logits, via_floats(IDS).logits)


def test_fp8_kernels_where_there_are_none_say_what_loads(checkpoint):
    folder, _ = checkpoint
    with pytest.raises(UnsupportedError, match=r"8\.9.*FP8Config\(dequantize=True\)"):
        AutoModelForCausalLM.from_pretrained(folder)  # the config from config.json, on the CPU


def test_block_checkpoint_errors(checkpoint, tmp_path):
    folder, _ = checkpoint
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="without their other half.*up_proj.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=FP8Config(dequantize=True))
    with pytest.raises(UnsupportedError, match="not one"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), quantization_config=FP8Config(dequantize=True))
    with pytest.raises(UnsupportedError, match="two positive ints"):
        FP8Config(weight_block_size=[128])
    with pytest.raises(UnsupportedError, match="e5m2"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), quantization_config={
            "quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})


def test_block_fp8_config_saves_as_per_channel_fp8():
    # The loaded weights are per-channel e4m3: a saved model must not claim blocks it no longer has,
    # or loading it back would pair the weights with scales that do not exist.
    read = FP8Config(weight_block_size=[128, 128], modules_to_not_convert=["lm_head", "model.layers.0.mlp"])
    saved = read.saved().to_dict()
    assert saved["quant_method"] == "fp8" and saved["weight_block_size"] is None
    assert saved["modules_to_not_convert"] == ["lm_head", "model.layers.0.mlp"]
    plain = FP8Config()
    assert plain.saved() is plain
