"""Packed q/k/v and gate/up projections: same numbers, same names, and out of the way of training
and adapters."""

import torch

import tiny
from cudaformers import AutoModelForCausalLM, LoraConfig, get_peft_model
from cudaformers.kernels.fused_projections import fuse_projections


def test_loaded_models_are_packed_and_match_transformers():
    folder = tiny.checkpoint("qwen2")  # qkv biases packed too
    model = AutoModelForCausalLM.from_pretrained(folder)
    attn = model.model.layers[0].self_attn
    assert attn.packed_qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert "packed" in model.explain()
    ids = torch.randint(3, 211, (2, 18))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny.hf_model(folder)(ids).logits, atol=1e-4, rtol=1e-4)
    assert set(model.state_dict()) == set(tiny.hf_model(folder).state_dict())


def test_training_uses_separate_parameters_and_updates_the_packed_copy():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama")).train()
    ids = torch.randint(3, 211, (2, 12))
    model(ids, labels=ids).loss.backward()
    attn = model.model.layers[1].self_attn
    assert attn.v_proj.weight.grad is not None and attn.v_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        attn.v_proj.weight.add_(1.0)  # an optimizer step writes through the view
    n_q, n_k = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert torch.equal(attn.packed_qkv.weight[n_q + n_k:], attn.v_proj.weight)


def test_lora_adapters_are_not_bypassed():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama")).eval()
    ids = torch.randint(3, 211, (1, 10))
    with torch.no_grad():
        before = model(ids).logits
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        after = peft(ids).logits
    assert not torch.allclose(before, after)


def test_packing_twice_is_harmless():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"))
    ids = torch.randint(3, 211, (1, 9))
    with torch.no_grad():
        before = model(ids).logits
        fuse_projections(model)
        torch.testing.assert_close(model(ids).logits, before)


def test_unpack_restores_separate_storage():
    from cudaformers.kernels.fused_projections import unpack_projections

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen2"))
    ids = torch.randint(3, 211, (1, 9))
    with torch.no_grad():
        before = model(ids).logits
    assert unpack_projections(model) == 4
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "packed_qkv") and attn.q_proj.weight.data_ptr() != attn.k_proj.weight.data_ptr()
    assert "projections" not in model.explain()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)


def test_packing_an_eval_model_packs_in_eval_mode(monkeypatch):
    """Packed after .eval(): the packed layers are in eval mode too, so inference runs the packed
    matmul (a packed layer left in training mode would quietly fall back to the separate ones, and
    every fold past it with them)."""
    from cudaformers.kernels.fused_projections import PackedLinear, unpack_projections

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"))
    unpack_projections(model)
    model.eval()
    assert fuse_projections(model) > 0
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and not any(m.training for m in packed)
    calls = []
    real = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: (calls.append(1), real(self, x))[1])
    with torch.no_grad():
        model(torch.randint(3, 211, (1, 7)))
    assert len(calls) == len(packed)
    model.train()
    assert all(m.training for m in packed)


def test_moving_the_model_keeps_its_projections_packed(monkeypatch):
    """model.to() moves every tensor on its own; afterwards the projections are views of their packed
    matrix again: the packed matmul runs, the weights are held once, and the numbers are the same."""
    from cudaformers.kernels.fused_projections import PackedLinear

    folder = tiny.checkpoint("qwen2")  # biases packed too
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(3, 211, (2, 9))
    with torch.no_grad():
        want = model(ids).logits.double()
    model = model.to(torch.float64)
    for attn in (layer.self_attn for layer in model.model.layers):
        assert attn.q_proj.weight.data_ptr() == attn.packed_qkv.weight.data_ptr()
        assert attn.v_proj.bias.data_ptr() == attn.packed_qkv.bias[-attn.v_proj.bias.shape[0]:].data_ptr()
        assert attn.q_proj.weight.dtype == torch.float64
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    params = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    assert sum(storages.values()) < 1.1 * params  # not the q/k/v and gate/up weights twice
    calls = []
    real = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: (calls.append(1), real(self, x))[1])
    with torch.no_grad():
        got = model(ids).logits
    assert len(calls) == 2 * len(model.model.layers)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_moving_a_quantized_model_restacks_its_projections(monkeypatch):
    """A quantized model's stacked projections sit outside the module tree; a move (here every tensor
    copied, as a device move does) stacks them again from the moved projections."""
    from cudaformers import Int4Config
    from cudaformers.quant.packing import PackedQuantLinear

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), quantization_config=Int4Config(group_size=32))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.packed_qkv, PackedQuantLinear)
    ids = torch.randint(3, 211, (1, 7))
    with torch.no_grad():
        want = model(ids).logits
    model._apply(lambda t: t.clone())
    assert attn.q_proj.weight.data_ptr() == attn.packed_qkv.layer.weight.data_ptr()
    assert not attn.packed_qkv.training
    calls = []
    real = PackedQuantLinear.forward
    monkeypatch.setattr(PackedQuantLinear, "forward", lambda self, x: (calls.append(1), real(self, x))[1])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
    assert len(calls) == 2 * len(model.model.layers)


def test_shared_memory_reaches_the_packed_matrix():
    """share_memory() is a move too: the restacked packed matrix, which the projections view, is shared."""
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).eval()
    model.share_memory()
    attn = model.model.layers[0].self_attn
    assert attn.packed_qkv.weight.is_shared() and attn.q_proj.weight.is_shared()
    assert attn.q_proj.weight.data_ptr() == attn.packed_qkv.weight.data_ptr()


def test_a_move_that_fails_half_way_leaves_the_projections_unpacked():
    from cudaformers.kernels.fused_projections import PackedLinear

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).eval()
    ids = torch.randint(3, 211, (1, 7))
    with torch.no_grad():
        want = model(ids).logits
    moved = []

    def fails_on_the_third(t):  # a move that runs out of memory: q moved, k not, then the error
        if len(moved) == 2:
            raise RuntimeError("out of memory")
        moved.append(1)
        return t.double()

    try:
        model._apply(fails_on_the_third)
    except RuntimeError:
        pass
    attn = model.model.layers[0].self_attn
    assert not isinstance(getattr(attn, "packed_qkv", None), PackedLinear)
    model._apply(lambda t: t.float())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want)


def test_moving_a_model_with_adapters_keeps_one_copy_of_the_base_weights():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama")).eval()
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    ids = torch.randint(3, 211, (1, 8))
    with torch.no_grad():
        want = peft(ids).logits.double()
    peft.to(torch.float64)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.base_layer.weight.data_ptr() == attn.packed_qkv.weight.data_ptr()
    assert attn.k_proj.weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, want, atol=1e-5, rtol=1e-5)


def test_a_move_that_moves_nothing_keeps_the_packed_storage():
    """.cuda() on the GPU, .float() in fp32: the same tensors, so the packed matrix keeps its storage
    (CUDA graphs captured before point at it)."""
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).eval()
    attn = model.model.layers[0].self_attn
    before = attn.packed_qkv.weight.data_ptr()
    model.float()
    assert attn.packed_qkv.weight.data_ptr() == before == attn.q_proj.weight.data_ptr()


def test_a_move_drops_the_cached_decode_runners():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).eval()
    ids = torch.randint(3, 211, (1, 5))
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert model.__dict__.get("_decode_runners")
    model.to(torch.float64)
    assert not model.__dict__.get("_decode_runners")
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == want.shape
