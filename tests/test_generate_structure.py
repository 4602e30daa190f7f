"""generate() keeps its decode runners (KV cache, CUDA graphs) across calls, and drops them when the
model they were made for changes: a graph must not replay modules, kernels or a backend the model
no longer has."""

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

import tiny
from cudaformers import AutoModelForCausalLM, KernelConfig, LoraConfig, get_peft_model
from cudaformers.kernels.hub import kernelize
from cudaformers.models import structure

KW = dict(max_new_tokens=3, do_sample=False)


def _runner(model):
    runners = model.__dict__.get("_decode_runners") or {}
    assert len(runners) == 1
    return next(iter(runners.values()))


def _model():
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3")).eval()


def test_repeated_calls_reuse_the_runner_and_leave_the_structure_count_alone():
    model, ids = _model(), torch.randint(3, 211, (1, 5))
    first = model.generate(ids, **KW)
    runner, stamp = _runner(model), structure.epoch()
    assert torch.equal(model.generate(ids, **KW), first)
    assert _runner(model) is runner and structure.epoch() == stamp


def test_a_new_attention_backend_drops_the_runner():
    model, ids = _model(), torch.randint(3, 211, (1, 5))
    want = model.generate(ids, **KW)
    runner = _runner(model)
    model.set_attn_implementation("eager")
    assert torch.equal(model.generate(ids, **KW), want)
    assert _runner(model) is not runner


def test_a_replaced_module_is_what_the_next_call_runs():
    model, ids = _model(), torch.randint(3, 211, (2, 6))
    model.generate(ids, **KW)
    runner = _runner(model)
    layer = model.model.layers[-1].mlp
    old = layer.down_proj
    new = nn.Linear(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight * 3.0)
    layer.down_proj = new
    got = model.generate(ids, **KW)
    assert _runner(model) is not runner
    fresh = _model()
    fresh.model.layers[-1].mlp.down_proj = new
    assert torch.equal(got, fresh.generate(ids, **KW))


def test_adapters_and_kernels_drop_the_runner():
    model, ids = _model(), torch.randint(3, 211, (1, 5))
    model.generate(ids, **KW)
    runner = _runner(model)
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    peft.eval()
    model.generate(ids, **KW)
    with_adapters = _runner(model)
    assert with_adapters is not runner
    kernelize(model, KernelConfig(kernel_mapping={"RMSNorm": "cudaformers:rms_norm"}))  # the interpreter runs it
    model.generate(ids, **KW)
    assert _runner(model) is not with_adapters


def test_what_changes_nothing_keeps_the_runner():
    """The same backend chosen again, a train/eval round trip and kernels bound as before keep the
    runner (a Trainer that evaluates with generate() would otherwise capture again every time)."""
    model, ids = _model(), torch.randint(3, 211, (1, 5))
    kernelize(model, use_kernels=False)
    model.generate(ids, **KW)
    runner = _runner(model)
    model.set_attn_implementation(model.config._attn_implementation)
    model.train()
    model.eval()
    kernelize(model, use_kernels=False)
    model.generate(ids, **KW)
    assert _runner(model) is runner


def test_registrations_traced_by_torch_compile_neither_count_nor_recompile():
    """transformers slices its ModuleList of layers inside every forward; traced by torch.compile, that
    registration must not move the count, or the compiled code guards on it and compiles again on every
    call (its compiled static-cache generate ran eagerly at a tenth of its speed)."""
    from torch._dynamo.testing import CompileCounter

    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(x):
        for layer in layers[:2]:  # a new ModuleList, registered while traced
            x = layer(x)
        return x

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(forward, backend=counter)
    x = torch.randn(2, 4)
    stamp = structure.epoch()
    for _ in range(3):
        torch.testing.assert_close(compiled(x), forward(x))
    assert counter.frame_count == 1
    forward(x)  # eager: the slice registers for real, and counts
    assert structure.epoch() > stamp
    torch._dynamo.reset()



@contextlib.contextmanager
def _collector_off():
    """Only reference counting frees objects inside (what was already garbage is collected first)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_runners_and_models_are_freed_without_the_garbage_collector():
    """A runner holds the KV cache and graphs: one a new shape replaces, and a dropped model with its
    runners, must go at once, not when the collector next runs (maybe inside a CUDA-graph capture)."""
    model = _model()
    model.generate(torch.randint(3, 211, (1, 5)), **KW)
    with _collector_off():
        old = weakref.ref(_runner(model))
        model.generate(torch.randint(3, 211, (3, 5)), **KW)  # another row count: another runner
        assert old() is None and _runner(model) is not None
        dropped = weakref.ref(model)
        del model
        assert dropped() is None


def test_packed_and_kernelized_modules_are_freed_with_their_model():
    """The packed projections and the kernels are bound onto the modules themselves; bound strongly,
    each module would sit in a cycle with its own method, and its weights (the packed q/k/v and
    gate/up matrices) would outlive ``del model`` until the collector ran. So would the blocks that
    activation checkpointing rebinds."""
    from cudaformers.distributed.blocks import checkpoint_blocks

    model = _model()
    kernelize(model, KernelConfig(kernel_mapping={"RMSNorm": "cudaformers:rms_norm"}))
    checkpoint_blocks(model)
    attention = model.model.layers[0].self_attn
    norm = model.model.layers[0].input_layernorm
    assert "project_qkv" in attention.__dict__ and "forward" in norm.__dict__  # bound on the instances
    model.generate(torch.randint(3, 211, (1, 5)), **KW)
    with _collector_off():
        left = [weakref.ref(m) for m in (attention, attention.packed_qkv, norm, model.model.layers[0].mlp,
                                         model.model.layers[1])]
        del attention, norm, model
        assert [ref() for ref in left] == [None] * len(left)


def test_a_weakly_bound_method_follows_deep_copies_and_names_a_freed_module():
    import copy

    from cudaformers.binding import bind

    def forward(self, x):
        return self.scale * x

    module = nn.Module()
    module.scale = 3
    module.forward = bind(forward, module)
    assert module(2) == 6 and module.forward.__func__ is forward and module.forward.__self__ is module
    twin = copy.deepcopy(module)
    twin.scale = 5
    assert twin(2) == 10 and twin.forward.__self__ is twin and module(2) == 6
    orphan = module.forward
    del module, twin
    with pytest.raises(ReferenceError, match="freed"):
        orphan(2)


def test_engine_is_freed_without_the_garbage_collector():
    from cudaformers.engine.llm_engine import LLMEngine

    model = _model()
    with _collector_off():
        dropped = weakref.ref(LLMEngine(model, num_blocks=64, block_size=4))
        assert dropped() is None
