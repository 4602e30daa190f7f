"""Mamba's two sequence ops, each as a PyTorch reference and a Triton forward kernel.

``causal_conv1d``: depthwise causal convolution over ``[B, C, L]`` continuing from a state of the
last ``K - 1`` inputs (zeros for a fresh sequence), so prefill and one-token decode are one op.
``selective_scan``: the selective state-space recurrence ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t u_t``,
``y_t = C_t h_t + D u_t``, gated by ``silu(z_t)``; one program owns a block of channels and walks the
sequence with its ``[channels, N]`` fp32 state in registers. Both return the state to continue from.
The kernels are forward-only: training uses the references (autograd through PyTorch ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# -- references ----------------------------------------------------------------------------------

def causal_conv1d_reference(x, weight, bias=None, state=None, silu: bool = False):
    """x ``[B, C, L]``, weight ``[C, K]``, state ``[B, C, K-1]`` or None -> (y ``[B, C, L]``, new state)."""
    b, c, seq = x.shape
    k = weight.shape[-1]
    if state is None:
        state = x.new_zeros(b, c, k - 1)
    full = torch.cat([state.to(x.dtype), x], dim=-1)  # [B, C, K-1+L]
    y = F.conv1d(full.to(weight.dtype), weight[:, None, :], bias, groups=c)
    if silu:
        y = F.silu(y)
    return y.to(x.dtype), full[:, :, -(k - 1):] if k > 1 else full[:, :, :0]


def selective_scan_reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, state=None):
    """u, delta, z ``[Bt, I, L]``; A ``[I, N]`` (fp32, negative); B, C ``[Bt, N, L]``; D, delta_bias ``[I]``;
    state ``[Bt, I, N]`` fp32 or None -> (y ``[Bt, I, L]`` in u's dtype, last state fp32). The
    discretisation and recurrence run in fp32, as in transformers' slow path."""
    dtype = u.dtype
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)[..., None]
    delta = F.softplus(delta.float())
    dA = torch.exp(A.float()[None, :, None, :] * delta[..., None])              # [Bt, I, L, N]
    dBu = delta[..., None] * B.float().transpose(1, 2)[:, None] * u.float()[..., None]
    h = state.float() if state is not None else u.new_zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float32)
    ys = []
    for t in range(u.shape[-1]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bin,bn->bi", h, C[:, :, t].float()))
    y = torch.stack(ys, dim=-1) if ys else u.new_zeros(u.shape, dtype=torch.float32)
    if D is not None:
        y = y + u.float() * D.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(dtype), h


# -- causal conv1d ---------------------------------------------------------------------------------

@triton.jit
def _conv1d_fwd(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, C, L, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                SILU: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    ls = tl.program_id(2) * BL + tl.arange(0, BL)
    cmask = cs < C
    acc = tl.zeros([BC, BL], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + cs * K + j, mask=cmask, other=0.0).to(tl.float32)
        src = ls - (K - 1) + j  # input position read by tap j; negative: from the state
        xv = tl.load(x_ptr + b * C * L + cs[:, None] * L + src[None, :],
                     mask=cmask[:, None] & (src[None, :] >= 0) & (src[None, :] < L), other=0.0).to(tl.float32)
        if HAS_STATE:
            sv = tl.load(s_ptr + b * C * (K - 1) + cs[:, None] * (K - 1) + (src[None, :] + K - 1),
                         mask=cmask[:, None] & (src[None, :] < 0) & (src[None, :] >= -(K - 1)), other=0.0)
            xv += sv.to(tl.float32)
        acc += w[:, None] * xv
    if HAS_BIAS:
        acc += tl.load(b_ptr + cs, mask=cmask, other=0.0).to(tl.float32)[:, None]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + b * C * L + cs[:, None] * L + ls[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=cmask[:, None] & (ls[None, :] < L))


def causal_conv1d(x, weight, bias=None, state=None, silu: bool = False):
    """Same contract as ``causal_conv1d_reference``."""
    b, c, seq = x.shape
    k = weight.shape[-1]
    x, weight = x.contiguous(), weight.reshape(c, k).contiguous()
    y = torch.empty_like(x)
    if state is not None:
        state = state.to(x.dtype).contiguous()
    if seq:
        grid = (b, triton.cdiv(c, 32), triton.cdiv(seq, 32))
        _conv1d_fwd[grid](x, weight, bias if bias is not None else weight, state if state is not None else x, y,
                          c, seq, HAS_BIAS=bias is not None, HAS_STATE=state is not None, SILU=silu, K=k,
                          BC=32, BL=32)
    prev = state if state is not None else x.new_zeros(b, c, k - 1)
    new_state = torch.cat([prev, x], dim=-1)[:, :, -(k - 1):] if k > 1 else x[:, :, :0]
    return y, new_state


# -- selective scan --------------------------------------------------------------------------------

@triton.jit
def _scan_fwd(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, h_ptr, y_ptr, I, L, N,
              HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
              BI: tl.constexpr, BN: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BI + tl.arange(0, BI)
    ns = tl.arange(0, BN)
    cmask, nmask = ch < I, ns < N
    m2 = cmask[:, None] & nmask[None, :]
    A = tl.load(a_ptr + ch[:, None] * N + ns[None, :], mask=m2, other=0.0).to(tl.float32)
    h_off = bt * I * N + ch[:, None] * N + ns[None, :]
    h = tl.load(h_ptr + h_off, mask=m2, other=0.0)  # initial state (zeros for a new sequence)
    if HAS_D:
        D = tl.load(d_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    row = bt * I * L + ch * L  # [BI] offsets of (bt, channel, t=0) in u / dt / z / y
    bc_row = bt * N * L + ns * L
    for t in range(L):
        u = tl.load(u_ptr + row + t, mask=cmask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + row + t, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt += bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus, as torch (threshold 20)
        Bt = tl.load(b_ptr + bc_row + t, mask=nmask, other=0.0).to(tl.float32)
        Ct = tl.load(c_ptr + bc_row + t, mask=nmask, other=0.0).to(tl.float32)
        h = tl.exp(A * dt[:, None]) * h + (dt * u)[:, None] * Bt[None, :]
        y = tl.sum(h * Ct[None, :], axis=1)
        if HAS_D:
            y += D * u
        if HAS_Z:
            zt = tl.load(z_ptr + row + t, mask=cmask, other=0.0).to(tl.float32)
            y = y * zt * tl.sigmoid(zt)
        tl.store(y_ptr + row + t, y.to(y_ptr.dtype.element_ty), mask=cmask)
    tl.store(h_ptr + h_off, h, mask=m2)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, state=None):
    """Same contract as ``selective_scan_reference``; the state is updated in a new tensor."""
    bt, i, seq = u.shape
    n = A.shape[1]
    u, delta, B, C = u.contiguous(), delta.contiguous(), B.contiguous(), C.contiguous()
    z = z.contiguous() if z is not None else None
    h = state.float().clone().contiguous() if state is not None else \
        torch.zeros(bt, i, n, device=u.device, dtype=torch.float32)
    y = torch.empty_like(u)
    bi = 16
    _scan_fwd[(bt, triton.cdiv(i, bi))](
        u, delta, A.float().contiguous(), B, C, D if D is not None else u, z if z is not None else u,
        delta_bias if delta_bias is not None else u, h, y, i, seq, n,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        BI=bi, BN=triton.next_power_of_2(n))
    return y, h
