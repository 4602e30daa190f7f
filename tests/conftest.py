import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    # GPU tests run only on a machine with a GPU; there, a missing GPU is a failure, not a skip.
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.usefixtures("_require_cuda"))


@pytest.fixture
def _require_cuda():
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA GPU; run `pytest -m gpu` on a GPU machine")
