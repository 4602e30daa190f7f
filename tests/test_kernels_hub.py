"""use_kernels / KernelConfig on a tiny model: what gets swapped, that results hold, train/eval swaps."""

import os
import sys
import types

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tiny  # noqa: E402
from cudaformers import AutoModelForCausalLM  # noqa: E402
from cudaformers.cli import main  # noqa: E402
from cudaformers.errors import UnsupportedError  # noqa: E402
from cudaformers.kernels.hub import KernelConfig, kernelize, resolve  # noqa: E402

ALL = {"RMSNorm": "cudaformers:rms_norm", "rotary_pos_emb": "cudaformers:rotary",
       "SiluAndMul": "cudaformers:act_and_mul",
       "ForCausalLMLoss": {"cpu": {"training": "cudaformers:fused_linear_cross_entropy", "inference": ""}}}


def _swapped(model):
    return sorted({type(m).__name__ for m in model.modules() if "forward" in m.__dict__})


def test_kernels_match_plain_model_in_inference_and_training():
    folder = tiny.checkpoint("qwen3")
    plain = AutoModelForCausalLM.from_pretrained(folder)
    fast = AutoModelForCausalLM.from_pretrained(folder, kernel_config=KernelConfig(ALL))
    assert _swapped(fast) == ["ApplyRotary", "GatedActivation", "RMSNorm"]
    assert fast.fused_loss is None  # inference: the loss kernel is mapped for training only
    ids = torch.randint(3, 211, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-4)
    fast.train(), plain.train()
    assert fast.fused_loss is not None and "fused_linear_cross_entropy" in fast.explain()
    loss, ref = fast(ids, labels=ids).loss, plain(ids, labels=ids).loss
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward(), ref.backward()
    ref_grads = dict(plain.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-4, rtol=1e-3, msg=name)
    fast.eval()
    assert fast.fused_loss is None


def test_use_kernels_on_cpu_keeps_plain_layers_and_says_why():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), use_kernels=True)
    assert _swapped(model) == [] and model.fused_loss is None
    assert "Triton kernels need a GPU" in model.explain()


def test_kernelize_is_reversible():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), kernel_config=KernelConfig(ALL))
    assert _swapped(model)
    kernelize(model, use_kernels=False)
    assert _swapped(model) == [] and "kernels" not in model._choices
    model.train()
    assert model.fused_loss is None  # no longer follows mode changes
    kernelize(model, KernelConfig({"RMSNorm": "cudaformers:rms_norm"}, inherit_mapping=False))
    assert _swapped(model) == ["RMSNorm"]


def test_default_mapping_on_cuda():
    assert resolve("RMSNorm", "cuda", "inference", None) == ("cudaformers:rms_norm", "default on cuda")
    assert resolve("ForCausalLMLoss", "cuda", "training", None)[0] == "cudaformers:fused_linear_cross_entropy"
    assert resolve("ForCausalLMLoss", "cuda", "inference", None)[0] == ""
    cfg = KernelConfig({"RMSNorm": {"cuda": ""}})
    assert resolve("RMSNorm", "cuda", "training", cfg) == ("", "mapped to '' (plain PyTorch)")
    assert resolve("rotary_pos_emb", "cuda", "training", cfg)[0] == "cudaformers:rotary"


def test_bad_mappings_are_clear_errors(monkeypatch):
    with pytest.raises(UnsupportedError, match="unknown layer type 'LayerNorm'"):
        KernelConfig({"LayerNorm": "cudaformers:rms_norm"})
    with pytest.raises(UnsupportedError, match="not a bundled kernel for RMSNorm"):
        KernelConfig({"RMSNorm": "cudaformers:rotary"})
    # Without the `kernels` package: what a Hub repo needs; with it: the bundled kernel to use instead.
    monkeypatch.setitem(sys.modules, "kernels", None)
    with pytest.raises(UnsupportedError, match="Hub kernel repo, which needs the `kernels` package"):
        KernelConfig({"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm"})
    monkeypatch.setitem(sys.modules, "kernels", types.ModuleType("kernels"))
    with pytest.raises(UnsupportedError, match="Hub kernel repo: cudaformers runs its bundled .* cudaformers:rms_norm"):
        KernelConfig({"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm"})
    # The stand-in has no module spec: transformers probes for the package (find_spec) as its model modules
    # first import, which the tiny checkpoint below may be the first to do in this process.
    monkeypatch.delitem(sys.modules, "kernels")
    with pytest.raises(UnsupportedError, match="mode 'eval'"):
        KernelConfig({"RMSNorm": {"cuda": {"eval": "cudaformers:rms_norm"}}})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UnsupportedError, match="need a CUDA GPU"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"),
                                             kernel_config=KernelConfig({"RMSNorm": "cudaformers:rms_norm"}))


def test_cli_lists_layer_types(capsys):
    assert main(["kernels", str(tiny.checkpoint("llama")), "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "RMSNorm" in out and "cudaformers:rms_norm (default on cuda)" in out
    assert "MoeExperts" not in out  # a dense model has no experts
    assert main(["kernels", "--device", "cpu"]) == 0
    assert "MoeExperts" in capsys.readouterr().out


def test_kernels_are_chosen_again_where_the_model_moves():
    """Kernels follow the device, as they follow the mode: a model loaded where its mapping keeps plain
    layers gets its kernels once moved where the mapping has them (the meta device stands in for a
    GPU here: the mapping names it)."""
    mapping = {"RMSNorm": {"cpu": "", "meta": "cudaformers:rms_norm"}}
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), kernel_config=KernelConfig(mapping))
    assert _swapped(model) == []
    model.to("meta")
    assert _swapped(model) == ["RMSNorm"]
    assert "RMSNorm -> cudaformers:rms_norm" in model.explain()
