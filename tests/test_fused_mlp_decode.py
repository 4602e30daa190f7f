"""The "GatedMLP" kernel (activation fused into the down projection's GEMV) on tiny models: the same
greedy tokens and logits as the plain model, used only at decode sizes without autograd, and never
around a down projection it would bypass (adapters, quantization)."""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import cudaformers.kernels.gemv as gemv_module  # noqa: E402
import tiny  # noqa: E402
from cudaformers import AutoModelForCausalLM, LoraConfig, get_peft_model  # noqa: E402
from cudaformers.errors import UnsupportedError  # noqa: E402
from cudaformers.kernels.hub import KernelConfig, resolve  # noqa: E402

FUSED = KernelConfig({"GatedMLP": "cudaformers:fused_mlp_decode"})


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []
    real = gemv_module.gemv_act_mul

    def counting(gate, *args):
        calls.append(gate.shape)
        return real(gate, *args)

    monkeypatch.setattr(gemv_module, "gemv_act_mul", counting)
    return calls


def _models(name):
    folder = tiny.checkpoint(name)
    plain = AutoModelForCausalLM.from_pretrained(folder, use_kernels=False).eval()
    return plain, AutoModelForCausalLM.from_pretrained(folder, kernel_config=FUSED).eval()


@pytest.mark.parametrize("name", ["qwen3", "llama_bias"])  # llama_bias: packed gate/up and down biases
def test_kernels_on_and_off_generate_the_same_tokens(name, fused_calls):
    plain, fused = _models(name)
    assert "GatedMLP -> cudaformers:fused_mlp_decode" in fused.explain()
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    want = plain.generate(ids, **kw)
    assert not fused_calls
    got = fused.generate(ids, **kw)
    assert torch.equal(got, want)
    layers = len(fused.model.layers)
    # The 7-row prefill takes the plain path; every one-token decode step, the fused GEMV.
    assert len(fused_calls) == (kw["max_new_tokens"] - 1) * layers
    assert all(shape[:-1].numel() == 1 for shape in fused_calls)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32])
def test_logits_close_at_and_past_the_row_limit(rows, fused_calls):
    plain, fused = _models("qwen3")
    ids = torch.randint(3, 211, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, atol=2e-5, rtol=1e-5)
    # The GEMV takes 1-4 rows; past that the activation runs on its own before the down projection.
    layers = len(fused.model.layers)
    assert len(fused_calls) == (layers if rows <= gemv_module.MAX_ROWS else 0)


def test_autograd_takes_the_plain_path(fused_calls):
    plain, fused = _models("llama")
    ids = torch.randint(3, 211, (1, 2))
    fused(ids).logits.sum().backward()  # eval mode, but grad enabled: parameters need gradients
    plain(ids).logits.sum().backward()
    assert not fused_calls
    down = fused.model.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(down.grad, plain.model.layers[0].mlp.down_proj.weight.grad)


def test_adapters_on_down_proj_are_not_bypassed(fused_calls):
    plain, fused = _models("llama")
    ids = torch.randint(3, 211, (1, 2))
    with torch.no_grad():
        before = plain(ids).logits
    config = LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False)  # random B: visible
    torch.manual_seed(0)
    plain_peft = get_peft_model(plain, config)
    torch.manual_seed(0)
    fused_peft = get_peft_model(fused, config)
    with torch.no_grad():
        after = fused_peft(ids).logits
        torch.testing.assert_close(after, plain_peft(ids).logits)
    assert not fused_calls and not torch.allclose(after, before)


def test_inference_only_and_default_on_cuda():
    assert resolve("GatedMLP", "cuda", "inference", None) == ("cudaformers:fused_mlp_decode", "default on cuda")
    # training gets the other GatedMLP kernel (tests/test_gated_mlp_recompute.py), never this one
    assert resolve("GatedMLP", "cuda", "training", None)[0] == "cudaformers:gated_mlp_recompute"
    assert resolve("GatedMLP", "cpu", "inference", None)[0] == ""
    with pytest.raises(UnsupportedError, match="no backward"):
        resolve("GatedMLP", "cuda", "training", FUSED)


@pytest.mark.parametrize("name", ["qwen3", "llama_bias"])
def test_skinny_rows_run_gate_up_and_activation_in_one_launch(name, monkeypatch):
    """At 5-32 rows, with the projections on the skinny GEMM and the act-and-mul kernel, the packed
    gate/up launch also applies the activation (``skinny_gated``): the same logits bit for bit as
    the two launches, and no act-and-mul launch."""
    import cudaformers.kernels.activation as activation
    import cudaformers.kernels.hub as hub
    import cudaformers.kernels.skinny_gemm as skinny

    config = KernelConfig({"GatedMLP": "cudaformers:fused_mlp_decode", "Linear": "cudaformers:gemv",
                           "SiluAndMul": "cudaformers:act_and_mul"})
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), kernel_config=config).eval()
    ids = torch.randint(3, 211, (1, 8), generator=torch.Generator().manual_seed(2))
    gated, act_launches = [], []
    real_gated, real_act = skinny.skinny_gated, activation.act_and_mul_forward
    monkeypatch.setattr(skinny, "skinny_gated", lambda *a, **k: gated.append(1) or real_gated(*a, **k))
    monkeypatch.setattr(activation, "act_and_mul_forward", lambda *a, **k: act_launches.append(1) or real_act(*a, **k))
    with torch.no_grad():
        got = model(ids).logits
        assert len(gated) == len(model.model.layers) and not act_launches
        monkeypatch.setattr(hub, "_gated_skinny", lambda mlp, x: None)  # the two launches
        want = model(ids).logits
    assert len(act_launches) == len(model.model.layers)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name,plan", [("qwen3", (2, 1, 1)), ("llama_bias", (2, 2, 2))])
def test_quantized_row_runs_gate_up_and_activation_in_one_launch(name, plan, monkeypatch):
    """One row of an int8 model with its gate/up packed: with ``quant_gemv_plans.GATED``, the fragment
    GEMV (here on the CPU, its PTX emulated) returns ``act(gate) * up`` itself, so no act-and-mul launch
    runs, and the logits are the two launches' up to the GEMV's own rounding."""
    import cudaformers.kernels.activation as activation
    import cudaformers.kernels.quant_gemv_mma as fragment
    import cudaformers.kernels.quant_gemv_plans as plans
    from cudaformers import Int8Config
    from ptx_exec import emulate_inline_asm

    config = KernelConfig({"GatedMLP": "cudaformers:fused_mlp_decode", "SiluAndMul": "cudaformers:act_and_mul"})
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), dtype=torch.bfloat16, kernel_config=config,
                                                 quantization_config=Int8Config()).eval()
    ids = torch.randint(3, 211, (1, 1), generator=torch.Generator().manual_seed(3))
    emulate_inline_asm(monkeypatch)
    gated, act_launches = [], []
    real_act = activation.act_and_mul_forward
    monkeypatch.setattr(activation, "act_and_mul_forward", lambda *a, **k: act_launches.append(1) or real_act(*a, **k))
    monkeypatch.setattr(fragment, "supports", lambda x, w: x.dtype == torch.bfloat16 and w.fmt == "int8")

    def launch(x, w, bias=None, act=None):
        gated.append(act)
        return fragment._launch(x, w, bias, plan, act)

    monkeypatch.setattr(fragment, "quant_gemv_mma", launch)
    with torch.no_grad():
        want = model(ids).logits  # switched off: the packed GEMV's reference, then the act-and-mul kernel
        assert not gated and len(act_launches) == len(model.model.layers)
        monkeypatch.setattr(plans, "GATED", ("int8",))
        act_launches.clear()
        got = model(ids).logits
    assert gated == ["silu"] * len(model.model.layers) and not act_launches
    torch.testing.assert_close(got, want, atol=0.01, rtol=0.02)  # logits ~0.5: a bf16 step or two
