"""The package surface: every public name imports, and the library never pulls in its test-only
dependencies or optional stacks (transformers, peft, openai, the server stack, gguf)."""

import subprocess
import sys

import cudaformers


def test_every_public_name_imports():
    for name in cudaformers.__all__:
        assert getattr(cudaformers, name) is not None, name


def test_core_paths_import_no_test_only_or_optional_packages():
    code = (
        "import sys, cudaformers\n"
        "for n in cudaformers.__all__:\n"
        "    getattr(cudaformers, n)\n"
        "import cudaformers.generation.generate, cudaformers.engine.llm_engine, cudaformers.train.trainer\n"
        "bad = [m for m in ('transformers', 'peft', 'openai', 'starlette', 'uvicorn', 'gguf') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported at library import time: {out.stdout.strip()}"
