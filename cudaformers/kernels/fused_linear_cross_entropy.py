"""Cross-entropy of ``hidden @ weight.T`` without ever holding the full ``[N, V]`` logits.

Tokens are processed in chunks: the chunk's logits are computed by one matmul, a Triton kernel turns
them in place into ``d loss / d logits`` (online logsumexp over the vocabulary, then softmax minus
one-hot, already divided by the number of counted targets), and two more matmuls fold that into the
gradients of hidden and weight. The gradients are therefore produced during the forward; backward
only scales them by the incoming gradient.

Chunk size is a trade-off between the logits buffer (``c x V`` values) and the weight-gradient
accumulator (``V x H`` fp32), which every chunk reads and writes once. Per chunk the weight-gradient
matmul does ``2 c V H`` flops against ``8 V H`` bytes of accumulator traffic: ``c / 4`` flops a byte,
so it stays compute-bound on an H100/H200 (ridge ~150-200) once a chunk has more than ~700 rows,
while 256-row chunks spend more time moving the accumulator than multiplying (qwen3-0.6b, 16k
tokens: 64 chunks x 1.2 GB = 78 GB of traffic, ~20 ms). Chunks are therefore sized from a byte budget
for the logits (``LOGITS_BUDGET``, 512 MiB: 1.7k rows of a 152k bf16 vocabulary) and balanced so the
last one is not a sliver. On CUDA the accumulation is the matmul's own epilogue (``addmm`` with an
fp32 output from bf16/fp16 inputs, beta = 1); where PyTorch lacks that overload the chunk's product is
added to the fp32 accumulator separately.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from . import loss_chunks

from ..layers.loss import IGNORE_INDEX, cross_entropy_from_logits
from .grid import next_power_of_2

logger = logging.getLogger("cudaformers")


@triton.jit
def _ce_rows(logits_ptr, stride_row, targets_ptr, loss_ptr, scale_ptr, n_cols, ignore_index,
             WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    ignored = target == ignore_index
    target = tl.where(ignored, 0, target)
    cols = tl.arange(0, BLOCK)
    # Pass 1: running max and rescaled sum of exponentials over vocabulary blocks.
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # Lanes that have seen only padding stay (-inf, 0) instead of turning into NaN.
        empty = m_new == float("-inf")
        s = tl.where(empty, 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), axis=0))
    target_logit = tl.load(base + target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target_logit))
    if WRITE_GRAD:
        # Pass 2: d loss / d logits = (softmax - onehot) * scale, written over the logits; ignored
        # rows contribute nothing.
        scale = tl.where(ignored, 0.0, tl.load(scale_ptr))
        for start in range(0, n_cols, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < n_cols, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(idx == target, 1.0, 0.0)
            tl.store(base + idx, (g * scale).to(logits_ptr.dtype.element_ty), mask=idx < n_cols)


LOGITS_BUDGET = loss_chunks.LOGITS_BUDGET


def _chunk_size(n: int, v: int, itemsize: int) -> int:
    return loss_chunks.chunk_rows(n, v, itemsize, LOGITS_BUDGET)


def _check_targets(targets, vocab, ignore_index):
    valid = (targets == ignore_index) | ((targets >= 0) & (targets < vocab))
    torch._assert_async(valid.all(), "fused cross-entropy: a target is outside [0, vocab_size) and is "
                                     "not ignore_index; check the labels")


# device type -> whether torch.addmm takes an fp32 accumulator with bf16/fp16 factors (out_dtype);
# found out on first use (the overload exists on CUDA from torch 2.8, and its dtype checks changed).
_FP32_EPILOGUE: dict[str, bool] = {}


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc``, in the matmul's epilogue where the dtypes allow."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    dev = acc.device.type
    if _FP32_EPILOGUE.get(dev, dev == "cuda"):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _FP32_EPILOGUE[dev] = True
            return
        except (RuntimeError, TypeError) as e:  # an older overload: rejected before any launch
            logger.debug("fused cross-entropy: torch.addmm has no fp32-output overload for %s here (%s); "
                         "adding each chunk's weight gradient separately", a.dtype, e)
            _FP32_EPILOGUE[dev] = False
    acc += a @ b


def _flce(hidden, weight, targets, scale, ignore_index, want_grad_h, want_grad_w, chunk):
    """-> (per-row loss [N] fp32, grad_hidden or None, grad_weight (fp32) or None)."""
    n, h = hidden.shape
    v = weight.shape[0]
    w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)  # autocast: one cast
    loss = torch.empty(n, device=hidden.device, dtype=torch.float32)
    grad_h = torch.empty_like(hidden) if want_grad_h else None
    grad_w = torch.zeros(v, h, device=weight.device, dtype=torch.float32) if want_grad_w else None
    write_grad = want_grad_h or want_grad_w
    cuda = hidden.device.type == "cuda"
    block = min(next_power_of_2(v), 4096 if cuda else 1024)
    warps = 8 if cuda and block >= 2048 else 4
    for start in range(0, n, chunk):
        h_c = hidden[start:start + chunk]
        logits = h_c @ w.t()  # [c, V], becomes d loss / d logits in place
        _ce_rows[(h_c.shape[0],)](logits, logits.stride(0), targets[start:start + chunk], loss[start:],
                                  scale, v, ignore_index, WRITE_GRAD=write_grad, BLOCK=block, num_warps=warps)
        if want_grad_h:
            torch.mm(logits, w, out=grad_h[start:start + chunk])
        if want_grad_w:
            _accumulate(grad_w, logits.t(), h_c)  # [V, c] @ [c, H]
        del logits
    return loss, grad_h, grad_w


def _scale(targets, num_items_in_batch, ignore_index):
    """1 / (number of counted targets), as a 1-element fp32 device tensor (no host sync)."""
    if num_items_in_batch is None:
        count = (targets != ignore_index).sum()
    else:
        count = torch.as_tensor(num_items_in_batch, device=targets.device)
    return (1.0 / count.to(torch.float32)).reshape(1)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, ignore_index, chunk):
        # Under autocast the residual stream is often fp32 while matmuls run in the autocast dtype:
        # compute in that dtype explicitly (autocast off inside, so out= buffers keep their dtypes)
        # and hand the hidden gradient back in the hidden's own dtype.
        compute = _compute_dtype(hidden)  # read before autocast is switched off
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grad_h, grad_w = _flce(hidden.to(compute), weight, targets, scale, ignore_index,
                                         ctx.needs_input_grad[0], ctx.needs_input_grad[1], chunk)
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss.sum() * scale[0]

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * grad_out.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_out).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                               chunk_size: int | None = None) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets)``: mean over targets != ignore_index, or their sum
    divided by ``num_items_in_batch`` (exact gradient accumulation). hidden ``[N, H]``, weight ``[V, H]``."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    hidden, targets = hidden.contiguous(), targets.contiguous()
    _check_targets(targets, weight.shape[0], ignore_index)
    scale = _scale(targets, num_items_in_batch, ignore_index)
    chunk = chunk_size or _chunk_size(hidden.shape[0], weight.shape[0], _compute_dtype(hidden).itemsize)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearCrossEntropy.apply(hidden, weight, targets, scale, ignore_index, chunk)
    loss, _, _ = _flce(hidden, weight, targets, scale, ignore_index, False, False, chunk)
    return loss.sum() * scale[0]


def fused_linear_cross_entropy_reference(hidden, weight, targets, num_items_in_batch=None):
    """Builds the full logits: the definition the fused version is tested against."""
    return cross_entropy_from_logits(hidden @ weight.to(hidden.dtype).t(), targets, num_items_in_batch)
