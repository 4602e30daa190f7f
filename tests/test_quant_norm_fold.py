"""A quantized decoder layer's post-attention norm folded into its GEMVs (kernels/quant_norm_fold.py) on
tiny int8 models: on the CPU the fragment GEMV runs in the interpreter with its PTX emulated. The logits
are the unfused layer's up to rounding, every layer folds at one row and none at more, and the fold
stays away from layers it would bypass."""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import cudaformers.kernels.quant_gemv_mma as fragment  # noqa: E402
import cudaformers.kernels.quant_norm_fold as fold  # noqa: E402
import tiny  # noqa: E402
from cudaformers import AutoModelForCausalLM, Int8Config, LoraConfig, get_peft_model  # noqa: E402
from cudaformers.kernels.hub import KernelConfig  # noqa: E402
from ptx_exec import emulate_inline_asm  # noqa: E402

KERNELS = KernelConfig({layer: {"cpu": {"inference": name, "training": ""}} for layer, name in (
    ("DecoderLayer", "cudaformers:fused_norm_decode"), ("GatedMLP", "cudaformers:fused_mlp_decode"),
    ("SiluAndMul", "cudaformers:act_and_mul"), ("RMSNorm", "cudaformers:rms_norm"))})


def _model(name="qwen3"):
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), dtype=torch.bfloat16, kernel_config=KERNELS,
                                                quantization_config=Int8Config()).eval()


@pytest.fixture
def emulated(monkeypatch):
    """The fragment GEMV on the CPU (its device check relaxed, its PTX emulated); returns the launches
    of the normed output projection."""
    emulate_inline_asm(monkeypatch)
    monkeypatch.setattr(fragment, "supports", lambda x, w: x.dtype == torch.bfloat16 and w.fmt == "int8"
                        and x.dim() == 2 and x.shape[0] == 1)
    plan = (2, 1, 2)
    normed = []
    monkeypatch.setattr(fragment, "default_plan", lambda n, fmt, device: plan)
    real = fragment.quant_gemv_mma_normed
    monkeypatch.setattr(fragment, "quant_gemv_mma_normed", lambda *a, **k: normed.append(1) or real(*a, **k))
    return normed


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("name", ["qwen3", "llama_bias"])  # llama_bias: biases on o, gate/up and down
def test_one_row_folds_the_norm_with_the_unfused_results(name, gated, emulated, monkeypatch):
    model = _model(name)
    ids = torch.randint(3, 211, (1, 1), generator=torch.Generator().manual_seed(4))
    outs = []  # each layer's MLP output, the first thing past the folded norm
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda mod, args, out: outs.append(out))
    with torch.no_grad():
        want = model(ids).logits
        assert not emulated
        monkeypatch.setattr(fold, "NORM_FOLD", True)
        monkeypatch.setattr(fragment, "GATED", ("int8",) if gated else ())
        got = model(ids).logits
    layers = len(model.model.layers)
    assert len(emulated) == layers and len(outs) == 2 * layers  # hooked down projections: no handoff
    # bf16 rounds elsewhere (here toward zero, as the interpreter does): up to ~1% of the outputs' norm,
    # where 1 / rms off by 10% moves them 3-20%.
    for unfused, folded in zip(outs[:layers], outs[layers:]):
        assert (folded.float() - unfused.float()).norm() <= 0.02 * unfused.float().norm()
    torch.testing.assert_close(got, want, atol=0.01, rtol=0.02)  # logits ~0.5: a bf16 step or two


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("name", ["qwen3", "llama_bias"])
def test_down_projection_hands_the_next_layer_its_normed_input(name, gated, emulated, monkeypatch):
    """Unhooked, each layer but the last ends in the next one's input norm: one more normed GEMV a layer,
    and the final hidden states (the lm_head's input) are the unfused ones up to rounding."""
    model = _model(name)
    ids = torch.randint(3, 211, (1, 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = _final_hidden(model, ids)
        monkeypatch.setattr(fold, "NORM_FOLD", True)
        monkeypatch.setattr(fragment, "GATED", ("int8",) if gated else ())
        got = _final_hidden(model, ids)
    layers = len(model.model.layers)
    assert len(emulated) == 2 * layers - 1
    assert (got - want).norm() <= 0.02 * want.norm()


def _final_hidden(model, ids):
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].float()))
    model(ids)
    handle.remove()
    return seen[0]


def test_more_rows_and_autograd_stay_unfused(emulated, monkeypatch):
    model = _model()
    monkeypatch.setattr(fold, "NORM_FOLD", True)
    with torch.no_grad():
        model(torch.randint(3, 211, (1, 3)))  # three rows: the unfused layer
    model(torch.randint(3, 211, (1, 1)))  # autograd on (eval mode, but gradients could be asked for)
    assert not emulated


def test_adapters_are_not_bypassed(emulated, monkeypatch):
    model = _model()
    config = LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False)
    peft = get_peft_model(model, config)
    monkeypatch.setattr(fold, "NORM_FOLD", True)
    with torch.no_grad():
        peft(torch.randint(3, 211, (1, 1)))
    assert not emulated  # an adapter on o_proj: the fold would skip it
    row = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert "output projection" in fold._declines(model.model.layers[0], row, row)  # the adapter wraps it in place


def test_generate_folds_every_decode_step(emulated, monkeypatch):
    """generate() on the CPU (the static cache's decode steps, eager): every one-token step folds, the
    prompt pass does not."""
    model = _model()
    monkeypatch.setattr(fold, "NORM_FOLD", True)
    monkeypatch.setattr(fragment, "GATED", ("int8",))
    ids = torch.randint(3, 211, (1, 5), generator=torch.Generator().manual_seed(6))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert out.shape == (1, 9)
    layers = len(model.model.layers)
    assert len(emulated) == 3 * (2 * layers - 1)  # steps 2-4 of 4: the first token comes from the prompt pass


def test_layers_find_their_successor_while_they_sit_in_their_list():
    import copy
    import pickle

    model = _model()
    first, second = model.model.layers
    assert fold._next_layer(first) is second and fold._next_layer(second) is None
    # Copies drop the link (a copied layer must not drag the whole list along) until kernels are bound again.
    assert fold._next_layer(copy.deepcopy(first)) is None
    assert pickle.loads(pickle.dumps(first.__dict__["_layer_list"])) is None
    model.model.layers[0] = copy.deepcopy(first)  # replaced after linking: the old one has no successor now
    assert fold._next_layer(first) is None
