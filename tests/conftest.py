import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in Triton's interpreter (small shapes only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _require_cuda(request):
    # GPU tests run only on a machine with a GPU; there, a missing GPU is a failure, not a skip.
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA GPU; run `pytest -m gpu` on a GPU machine")
