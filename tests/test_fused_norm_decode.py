"""The "DecoderLayer" kernel (each RMSNorm folded into the GEMV after it) on tiny models: the same greedy
tokens and logits as the unfused kernels and as plain PyTorch, only at decode sizes without autograd,
never around a projection it would bypass, and only on the dense decoder layer class."""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import cudaformers.kernels.fused_norm_decode as fused_module  # noqa: E402
import tiny  # noqa: E402
from cudaformers import AutoConfig, AutoModelForCausalLM, LoraConfig, get_peft_model  # noqa: E402
from cudaformers.cli import main  # noqa: E402
from cudaformers.errors import UnsupportedError  # noqa: E402
from cudaformers.kernels.hub import LAYER_TYPES, KernelConfig, kernelize, resolve  # noqa: E402

# The decode kernels the fold sits among (what use_kernels=True gives on CUDA), with and without it.
DECODE = {"RMSNorm": "cudaformers:rms_norm", "Linear": "cudaformers:gemv",
          "GatedMLP": {"cpu": {"inference": "cudaformers:fused_mlp_decode", "training": ""}},
          "rotary_pos_emb": {"cpu": {"inference": "cudaformers:qk_norm_rope", "training": ""}}}
UNFUSED = KernelConfig({**DECODE, "DecoderLayer": ""})
FUSED = KernelConfig({**DECODE, "DecoderLayer": {"cpu": {"inference": "cudaformers:fused_norm_decode",
                                                         "training": ""}}})


@pytest.fixture
def folds(monkeypatch):
    """Rows seen by each fused norm + GEMV launch."""
    calls = []
    real = fused_module.gemv_rms_norm

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fused_module, "gemv_rms_norm", counting)
    return calls


def _models(name, dtype=torch.float32):
    folder = tiny.checkpoint(name)
    load = dict(dtype=dtype)
    return (AutoModelForCausalLM.from_pretrained(folder, kernel_config=UNFUSED, **load).eval(),
            AutoModelForCausalLM.from_pretrained(folder, kernel_config=FUSED, **load).eval())


GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)


@pytest.mark.parametrize("name", ["qwen3", "llama_bias"])  # llama_bias: packed q/k/v and gate/up biases
def test_generates_the_unfused_and_the_plain_tokens(name, folds):
    unfused, fused = _models(name)
    assert "DecoderLayer -> cudaformers:fused_norm_decode" in fused.explain()
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), use_kernels=False).eval()
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(1))
    want = unfused.generate(ids, **GREEDY)
    assert not folds
    got = fused.generate(ids, **GREEDY)
    assert torch.equal(got, want)
    assert torch.equal(got, plain.generate(ids, **GREEDY))
    # The 7-row prefill runs unfolded; every one-token step folds both norms of every layer.
    assert folds == [1] * ((GREEDY["max_new_tokens"] - 1) * 2 * len(fused.model.layers))


@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_logits_equal_the_unfused_kernels_at_and_past_the_row_limit(rows, folds):
    unfused, fused = _models("qwen3")
    ids = torch.randint(3, 211, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        got, want = fused(ids).logits, unfused(ids).logits
    # The folded norm rounds as the unfused kernel does, and on the interpreter (numpy) a row of one
    # K tile sums its squares in the same order: the same bits.
    assert torch.equal(got, want)
    assert folds == ([rows] * 2 * len(fused.model.layers) if rows <= 4 else [])


def test_wide_layers_stay_unfolded(folds, monkeypatch):
    """Past FOLD_MAX_HIDDEN features the fold costs more than the launch it saves (measured at
    hidden 4096): the layer runs unfused, with the same logits."""
    unfused, fused = _models("qwen3")
    hidden = fused.config.hidden_size
    monkeypatch.setattr(fused_module, "FOLD_MAX_HIDDEN", hidden - 1)
    ids = torch.randint(3, 211, (1, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, unfused(ids).logits)
    assert not folds
    monkeypatch.setattr(fused_module, "FOLD_MAX_HIDDEN", hidden)
    with torch.no_grad():
        fused(ids)
    assert folds == [1] * 2 * len(fused.model.layers)


def test_bf16_decode_logits_and_tokens(folds):
    unfused, fused = _models("qwen3_tied", torch.bfloat16)
    ids = torch.randint(3, 211, (1, 5), generator=torch.Generator().manual_seed(3))
    greedy = {**GREEDY, "max_new_tokens": 5}
    assert torch.equal(fused.generate(ids, **greedy), unfused.generate(ids, **greedy))
    with torch.no_grad():
        one = ids[:, :1]
        assert torch.equal(fused(one).logits, unfused(one).logits)  # bf16 rounding steps as in rms_norm
    decode_steps = greedy["max_new_tokens"] - 1
    assert len(folds) == (decode_steps + 1) * 2 * len(fused.model.layers)  # and the one-token forward


def test_autograd_takes_the_plain_path(folds):
    _, fused = _models("llama")
    ids = torch.randint(3, 211, (1, 2))
    fused(ids).logits.sum().backward()  # eval mode, grad enabled: the parameters want gradients
    assert not folds
    assert fused.model.layers[0].input_layernorm.weight.grad is not None


def test_train_restores_the_plain_forward_and_eval_the_fold():
    _, fused = _models("llama")
    layers = fused.model.layers
    assert all("forward" in layer.__dict__ for layer in layers)
    fused.train()
    assert not any("forward" in layer.__dict__ for layer in layers)
    fused.eval()
    assert all("forward" in layer.__dict__ for layer in layers)
    kernelize(fused, use_kernels=False)
    assert not any("forward" in layer.__dict__ for layer in layers)
    names = dict(fused.named_parameters())
    assert "model.layers.0.input_layernorm.weight" in names and "model.layers.1.mlp.gate_proj.weight" in names


def test_adapters_keep_their_half_of_the_layer_unfolded(folds):
    unfused, fused = _models("llama")
    config = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)  # random B: visible
    torch.manual_seed(0)
    unfused_peft = get_peft_model(unfused, config)
    torch.manual_seed(0)
    fused_peft = get_peft_model(fused, config)
    ids = torch.randint(3, 211, (1, 2))
    with torch.no_grad():
        torch.testing.assert_close(fused_peft(ids).logits, unfused_peft(ids).logits, atol=1e-5, rtol=1e-5)
    # q/k/v would bypass the adapter: only the post-attention norms fold into gate/up.
    assert folds == [2] * len(fused.model.layers)


def test_only_the_dense_decoder_layer_class_matches():
    from cudaformers.distributed.blocks import checkpoint_blocks
    from cudaformers.models.registry import model_class_for

    config = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                  num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=64,
                                  architectures=["Qwen3MoeForCausalLM"])
    with torch.device("meta"):
        moe = model_class_for(config)(config)
    matches = LAYER_TYPES["DecoderLayer"].matches
    assert not any(matches(m) for m in moe.modules())  # Qwen3MoeDecoderLayer subclasses DecoderLayer
    _, fused = _models("llama")
    kernelize(fused, use_kernels=False)
    checkpoint_blocks(fused)  # a forward patched by someone else is never replaced (nor popped)
    assert not any(matches(layer) for layer in fused.model.layers)
    kernelize(fused, FUSED)
    assert all(layer._cf_checkpointed and "forward" in layer.__dict__ for layer in fused.model.layers)
    assert "DecoderLayer" not in fused.explain()


def test_default_on_cuda_in_inference_only(capsys):
    assert resolve("DecoderLayer", "cuda", "inference", None) == ("cudaformers:fused_norm_decode", "default on cuda")
    assert resolve("DecoderLayer", "cuda", "training", None)[0] == ""
    assert resolve("DecoderLayer", "cpu", "inference", None)[0] == ""
    assert resolve("DecoderLayer", "cuda", "inference", KernelConfig({"DecoderLayer": ""}))[0] == ""
    with pytest.raises(UnsupportedError, match="no backward"):
        resolve("DecoderLayer", "cuda", "training", KernelConfig({"DecoderLayer": "cudaformers:fused_norm_decode"}))
    assert main(["kernels", str(tiny.checkpoint("qwen3")), "--device", "cuda"]) == 0
    assert "cudaformers:fused_norm_decode (default on cuda)" in capsys.readouterr().out


def test_explain_says_what_the_decode_layer_does_as_switched(monkeypatch):
    from cudaformers.kernels import quant_gemv_plans

    _, fused = _models("qwen3")
    monkeypatch.setattr(quant_gemv_plans, "GATED", ())
    assert "decode layer: norms folded" in fused.explain() and "gate/up at one row" not in fused.explain()
    monkeypatch.setattr(quant_gemv_plans, "GATED", ("int4", "int8"))  # switched after loading: explain() says so
    assert "int4/int8 gate/up at one row: act(gate) * up in the GEMV" in fused.explain()
    unfused, _ = _models("qwen3")
    assert "decode layer" not in unfused.explain()
