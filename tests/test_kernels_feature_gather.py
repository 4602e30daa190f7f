"""The feature gather of act-order int4 layers (``kernels/feature_gather.py``) against ``index_select``,
forward and backward, on odd and power-of-two widths (Triton's interpreter on the CPU)."""

import pytest
import torch

from cudaformers.kernels.feature_gather import gather_features, gather_features_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 37), (2, 5, 130), (1, 2048), (2, 2500)])
def test_gather_matches_index_select(shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
    order = torch.randperm(shape[-1], generator=gen)
    out = gather_features(x, order)
    ref_x = x.detach().clone().requires_grad_()
    ref = gather_features_reference(ref_x, order)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dy = torch.randn(shape, generator=gen).to(dtype)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)


def test_gather_reads_rows_of_any_stride_and_int32_orders():
    x = torch.randn(4, 96)[:, :48]  # rows 96 apart
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    torch.testing.assert_close(gather_features(x, order), x[:, order.long()], rtol=0, atol=0)


def test_a_wrong_order_is_refused():
    with pytest.raises(ValueError, match="permutation of x's last dimension \\(8\\)"):
        gather_features(torch.randn(2, 8), torch.arange(7))
    with pytest.raises(ValueError, match="int32/int64"):
        gather_features(torch.randn(2, 8), torch.arange(8).float())
