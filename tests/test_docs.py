"""The user guides' code examples run: every ```python block of a guide, in order, in a fresh
interpreter. Blocks fenced ```python gpu run only in the GPU suite. Blocks fenced ```python hub
need a model downloaded from the Hub or a path of the reader's own (the GPU machine and CI are
offline): they are compiled, not run."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^```python(?P<tag>[ \t]+gpu)?[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
ANY_PYTHON = re.compile(r"^```python[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
GUIDES = sorted(DOCS.glob("*.md"))


def blocks(path: Path, gpu: bool) -> list[str]:
    return [m["code"] for m in FENCE.finditer(path.read_text()) if bool(m["tag"]) == gpu]


def run_blocks(code_blocks: list[str], tmp_path) -> None:
    script = "\n\n".join(code_blocks)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.stem)
def test_every_example_compiles(guide):
    for i, m in enumerate(ANY_PYTHON.finditer(guide.read_text())):
        compile(m["code"], f"{guide.name}[block {i}]", "exec")


def test_guides_exist_in_reading_order():
    names = [p.name for p in GUIDES]
    assert names == sorted(names) and len(names) >= 10, names


@pytest.mark.parametrize("guide", [p for p in GUIDES if blocks(p, gpu=False)], ids=lambda p: p.stem)
def test_guide_examples_run_on_cpu(guide, tmp_path):
    run_blocks(blocks(guide, gpu=False), tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("guide", [p for p in GUIDES if blocks(p, gpu=True)], ids=lambda p: p.stem)
def test_guide_gpu_examples(guide, tmp_path):
    run_blocks(blocks(guide, gpu=False) + blocks(guide, gpu=True), tmp_path)


MAKE_COMMAND = re.compile(r"\bmake (?P<target>[a-z][a-z-]*)")
MAKE_TARGET = re.compile(r"^(?P<target>[a-z][a-z-]*):", re.M)


def test_make_commands_in_the_guides_name_makefile_targets():
    root = DOCS.parent
    targets = set(MAKE_TARGET.findall((root / "Makefile").read_text()))
    named = {m["target"]: path.name for path in [root / "README.md", *GUIDES]
             for m in MAKE_COMMAND.finditer(path.read_text())}
    assert {"run", "test", "offline-wheels"} <= set(named)
    missing = {target: where for target, where in named.items() if target not in targets}
    assert not missing, f"make targets named in the guides but not in the Makefile: {missing}"
