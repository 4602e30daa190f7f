"""Rules the Triton compiler enforces on the GPU but the interpreter (which runs these tests) does
not: a @triton.jit function may read a module-level value only if it is a ``tl.constexpr(...)``
object, a function, a module or a dtype. A plain ``X = 3`` (or ``X: tl.constexpr = 3``, which is
still a plain int) passes every CPU test and fails to compile on the first GPU call."""

import importlib
import pkgutil
import types

import pytest
import triton.language as tl

import cudaformers

PLAIN = (int, float, bool, str)


def _jit_functions():
    for info in pkgutil.walk_packages(cudaformers.__path__, "cudaformers."):
        if info.name.endswith(("server", "server_app", "server_engine", "openai_protocol")):
            continue  # the web stack is optional and holds no kernels
        try:
            module = importlib.import_module(info.name)
        except ImportError as e:  # an optional dependency (gguf, the web stack) absent here
            if "cudaformers" in str(e):
                raise
            continue
        for name, value in vars(module).items():
            if _is_jit(value) and value.fn.__module__ == module.__name__:
                yield f"{info.name}.{name}", value


def _is_jit(value) -> bool:
    # Under TRITON_INTERPRET=1 (these tests) @triton.jit makes an InterpretedFunction instead.
    return type(value).__name__ in ("JITFunction", "InterpretedFunction") and isinstance(
        getattr(value, "fn", None), types.FunctionType)


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


KERNELS = dict(_jit_functions())


def test_kernels_were_found():
    assert len(KERNELS) > 30 and any("quant_matmul" in k for k in KERNELS) and any("gemv" in k for k in KERNELS)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_jit_function_reads_no_plain_globals(name):
    fn = KERNELS[name].fn
    bad = sorted(n for n in set(_names(fn.__code__))
                 if isinstance(fn.__globals__.get(n), PLAIN) and not isinstance(fn.__globals__.get(n), tl.constexpr))
    assert not bad, (f"{name} reads module-level {bad} as plain Python values; compiled Triton rejects that. "
                     f"Define them as NAME = tl.constexpr(value)")
