"""Mamba's two sequence ops, each as a PyTorch reference and a Triton forward kernel.

``causal_conv1d``: depthwise causal convolution over ``[B, C, L]`` continuing from a state of the
last ``K - 1`` inputs (zeros for a fresh sequence), so prefill and one-token decode are one op.
``selective_scan``: the selective state-space recurrence ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t u_t``,
``y_t = C_t h_t + D u_t``, gated by ``silu(z_t)``; one program owns a block of channels and walks the
sequence with its ``[channels, N]`` fp32 state in registers. Both return the state to continue from.

Both are differentiable (``torch.autograd.Function``s, used when an input requires grad). The conv
backward recomputes the pre-activation, then a second launch correlates the output gradient with the
taps. The scan backward recomputes the forward: a first pass stores the state at every chunk of
``_SCAN_CHUNK`` steps, then chunks are walked in reverse, each re-run forward into a small per-program
buffer and then stepped backward through time, so memory is ``O(L / chunk)`` states, not ``O(L)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .grid import cdiv, next_power_of_2


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
def _conv_tap(x_ptr, s_ptr, b, cs, ls, cmask, C, L, j, HAS_STATE: tl.constexpr, K: tl.constexpr):
    """[BC, BL] fp32: the input that tap j multiplies at outputs ls (from the state where before x)."""
    src = ls - (K - 1) + j
    xv = tl.load(x_ptr + b * C * L + cs[:, None] * L + src[None, :],
                 mask=cmask[:, None] & (src[None, :] >= 0) & (src[None, :] < L), other=0.0).to(tl.float32)
    if HAS_STATE:
        sv = tl.load(s_ptr + b * C * (K - 1) + cs[:, None] * (K - 1) + (src[None, :] + K - 1),
                     mask=cmask[:, None] & (src[None, :] < 0) & (src[None, :] >= -(K - 1)), other=0.0)
        xv += sv.to(tl.float32)
    return xv


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
        acc += w[:, None] * _conv_tap(x_ptr, s_ptr, b, cs, ls, cmask, C, L, j, HAS_STATE, K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cs, mask=cmask, other=0.0).to(tl.float32)[:, None]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + b * C * L + cs[:, None] * L + ls[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=cmask[:, None] & (ls[None, :] < L))


@triton.jit
def _conv1d_bwd_act(x_ptr, w_ptr, b_ptr, s_ptr, dy_ptr, g_ptr, dw_ptr, db_ptr, C, L, HAS_BIAS: tl.constexpr,
                    HAS_STATE: tl.constexpr, SILU: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
                    BL: tl.constexpr):
    """g = dy * act'(pre) (fp32, stored for the input gradient); this tile's share of dw and db."""
    b = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    ls = tl.program_id(2) * BL + tl.arange(0, BL)
    cmask = cs < C
    tile = cmask[:, None] & (ls[None, :] < L)
    g = tl.load(dy_ptr + b * C * L + cs[:, None] * L + ls[None, :], mask=tile, other=0.0).to(tl.float32)
    if SILU:  # recompute the pre-activation; silu'(a) = s (1 + a (1 - s))
        pre = tl.zeros([BC, BL], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + cs * K + j, mask=cmask, other=0.0).to(tl.float32)
            pre += w[:, None] * _conv_tap(x_ptr, s_ptr, b, cs, ls, cmask, C, L, j, HAS_STATE, K)
        if HAS_BIAS:
            pre += tl.load(b_ptr + cs, mask=cmask, other=0.0).to(tl.float32)[:, None]
        sig = tl.sigmoid(pre)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    tl.store(g_ptr + b * C * L + cs[:, None] * L + ls[None, :], g, mask=tile)
    part = (b * tl.num_programs(2) + tl.program_id(2)) * C  # this tile's row in the [B * L-tiles, C] partials
    for j in tl.static_range(K):
        xv = _conv_tap(x_ptr, s_ptr, b, cs, ls, cmask, C, L, j, HAS_STATE, K)
        tl.store(dw_ptr + (part + cs) * K + j, tl.sum(g * xv, axis=1), mask=cmask)
    if HAS_BIAS:
        tl.store(db_ptr + part + cs, tl.sum(g, axis=1), mask=cmask)


@triton.jit
def _conv1d_bwd_input(g_ptr, w_ptr, dx_ptr, ds_ptr, C, L, HAS_STATE: tl.constexpr, K: tl.constexpr,
                      BC: tl.constexpr, BL: tl.constexpr):
    """d full[p] = sum_j w[j] g[p - j] over the ``K - 1 + L`` positions of cat(state, x)."""
    b = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    ps = tl.program_id(2) * BL + tl.arange(0, BL)
    cmask = cs < C
    acc = tl.zeros([BC, BL], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + cs * K + j, mask=cmask, other=0.0).to(tl.float32)
        out = ps - j  # the output position that read p through tap j
        gv = tl.load(g_ptr + b * C * L + cs[:, None] * L + out[None, :],
                     mask=cmask[:, None] & (out[None, :] >= 0) & (out[None, :] < L), other=0.0)
        acc += w[:, None] * gv
    xs = ps - (K - 1)
    tl.store(dx_ptr + b * C * L + cs[:, None] * L + xs[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=cmask[:, None] & (xs[None, :] >= 0) & (xs[None, :] < L))
    if HAS_STATE:
        tl.store(ds_ptr + b * C * (K - 1) + cs[:, None] * (K - 1) + ps[None, :], acc.to(ds_ptr.dtype.element_ty),
                 mask=cmask[:, None] & (ps[None, :] < K - 1))


_CONV_BLOCK = 32


def _conv1d_forward(x, weight, bias, state, silu):
    b, c, seq = x.shape
    k = weight.shape[-1]
    y = torch.empty_like(x)
    if seq:
        grid = (b, cdiv(c, _CONV_BLOCK), cdiv(seq, _CONV_BLOCK))
        _conv1d_fwd[grid](x, weight, bias if bias is not None else weight, state if state is not None else x, y,
                          c, seq, HAS_BIAS=bias is not None, HAS_STATE=state is not None, SILU=silu, K=k,
                          BC=_CONV_BLOCK, BL=_CONV_BLOCK)
    return y


class _CausalConv1dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state, silu):
        ctx.save_for_backward(x, weight, bias, state)
        ctx.silu = silu
        return _conv1d_forward(x, weight, bias, state, silu)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, state = ctx.saved_tensors
        b, c, seq = x.shape
        k = weight.shape[-1]
        bl = _CONV_BLOCK
        n_lt = cdiv(seq, bl)
        g = torch.empty(b, c, seq, device=x.device, dtype=torch.float32)
        dw = torch.zeros(b * n_lt, c, k, device=x.device, dtype=torch.float32)  # per-tile partials
        db = torch.zeros(b * n_lt, c, device=x.device, dtype=torch.float32)
        dx = torch.empty_like(x)
        ds = torch.empty_like(state) if state is not None else None
        if seq:
            _conv1d_bwd_act[(b, cdiv(c, _CONV_BLOCK), n_lt)](
                x, weight, bias if bias is not None else weight, state if state is not None else x,
                dy.contiguous(), g, dw, db, c, seq, HAS_BIAS=bias is not None, HAS_STATE=state is not None,
                SILU=ctx.silu, K=k, BC=_CONV_BLOCK, BL=bl)
        _conv1d_bwd_input[(b, cdiv(c, _CONV_BLOCK), cdiv(seq + k - 1, bl))](
            g, weight, dx, ds if ds is not None else dx, c, seq, HAS_STATE=state is not None, K=k,
            BC=_CONV_BLOCK, BL=bl)
        db = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dw.sum(0).to(weight.dtype), db, ds, None


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def causal_conv1d(x, weight, bias=None, state=None, silu: bool = False):
    """Same contract as ``causal_conv1d_reference``; differentiable in x, weight, bias and state."""
    b, c, seq = x.shape
    k = weight.shape[-1]
    x, weight = x.contiguous(), weight.reshape(c, k).contiguous()
    if state is not None:
        state = state.to(x.dtype).contiguous()
    if _wants_grad(x, weight, bias, state):
        y = _CausalConv1dFn.apply(x, weight, bias, state, silu)
    else:
        y = _conv1d_forward(x, weight, bias, state, silu)
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


@triton.jit
def _scan_step_inputs(u_ptr, dt_ptr, b_ptr, c_ptr, row, bc_row, t, cmask, nmask, bias, HAS_BIAS: tl.constexpr):
    """u, softplus(dt + bias), dt's softplus derivative ([BI]) and B_t, C_t ([BN]) at step t, in fp32."""
    u = tl.load(u_ptr + row + t, mask=cmask, other=0.0).to(tl.float32)
    raw = tl.load(dt_ptr + row + t, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += bias
    dt = tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw)))
    d_soft = tl.where(raw > 20.0, 1.0, tl.sigmoid(raw))
    Bt = tl.load(b_ptr + bc_row + t, mask=nmask, other=0.0).to(tl.float32)
    Ct = tl.load(c_ptr + bc_row + t, mask=nmask, other=0.0).to(tl.float32)
    return u, dt, d_soft, Bt, Ct


@triton.jit
def _scan_bwd(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, h0_ptr, dy_ptr, dhl_ptr,
              ckpt_ptr, hbuf_ptr, du_ptr, ddt_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr, dh0_ptr,
              I, L, N, n_chunks, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
              T: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr):
    """Reverse-time scan of one (sequence, channel block). Per-step reductions over channels (dB, dC)
    and per-sequence sums (dA, dD, dbias) go to per-program partials, summed on the host side."""
    bt = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    ch = cb * BI + tl.arange(0, BI)
    ns = tl.arange(0, BN)
    cmask, nmask = ch < I, ns < N
    m2 = cmask[:, None] & nmask[None, :]
    A = tl.load(a_ptr + ch[:, None] * N + ns[None, :], mask=m2, other=0.0).to(tl.float32)
    D = tl.zeros([BI], dtype=tl.float32)
    if HAS_D:
        D = tl.load(d_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    bias = tl.zeros([BI], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    hn = ch[:, None] * N + ns[None, :]  # [BI, BN] offsets of this block inside one [I, N] state
    row = bt * I * L + ch * L
    bc_row = bt * N * L + ns * L
    part_row = (bt * tl.num_programs(1) + cb) * N * L + ns * L  # this program's [N, L] slice of dB/dC partials
    # Pass 1: the state entering every chunk.
    h = tl.load(h0_ptr + bt * I * N + hn, mask=m2, other=0.0)
    for c in range(n_chunks):
        tl.store(ckpt_ptr + (bt * n_chunks + c) * I * N + hn, h, mask=m2)
        for t in range(c * T, tl.minimum(c * T + T, L)):
            u, dt, _, Bt, _ = _scan_step_inputs(u_ptr, dt_ptr, b_ptr, c_ptr, row, bc_row, t, cmask, nmask,
                                                bias, HAS_BIAS)
            h = tl.exp(A * dt[:, None]) * h + (dt * u)[:, None] * Bt[None, :]
    # Pass 2: chunks in reverse; dh is the gradient reaching the state after the current step.
    dh = tl.load(dhl_ptr + bt * I * N + hn, mask=m2, other=0.0)
    dA = tl.zeros([BI, BN], dtype=tl.float32)
    dD = tl.zeros([BI], dtype=tl.float32)
    dbias = tl.zeros([BI], dtype=tl.float32)
    for cc in range(n_chunks):
        t0 = (n_chunks - 1 - cc) * T
        t1 = tl.minimum(t0 + T, L)
        h = tl.load(ckpt_ptr + (bt * n_chunks + n_chunks - 1 - cc) * I * N + hn, mask=m2, other=0.0)
        for t in range(t0, t1):  # replay the chunk, keeping the state entering each step
            tl.store(hbuf_ptr + (bt * T + t - t0) * I * N + hn, h, mask=m2)
            u, dt, _, Bt, _ = _scan_step_inputs(u_ptr, dt_ptr, b_ptr, c_ptr, row, bc_row, t, cmask, nmask,
                                                bias, HAS_BIAS)
            h = tl.exp(A * dt[:, None]) * h + (dt * u)[:, None] * Bt[None, :]
        tl.debug_barrier()
        for tt in range(t1 - t0):
            t = t1 - 1 - tt
            h_prev = tl.load(hbuf_ptr + (bt * T + t - t0) * I * N + hn, mask=m2, other=0.0)
            u, dt, d_soft, Bt, Ct = _scan_step_inputs(u_ptr, dt_ptr, b_ptr, c_ptr, row, bc_row, t, cmask, nmask,
                                                      bias, HAS_BIAS)
            decay = tl.exp(A * dt[:, None])
            h_t = decay * h_prev + (dt * u)[:, None] * Bt[None, :]
            g = tl.load(dy_ptr + row + t, mask=cmask, other=0.0).to(tl.float32)
            if HAS_Z:  # out = y * silu(z)
                zt = tl.load(z_ptr + row + t, mask=cmask, other=0.0).to(tl.float32)
                sz = tl.sigmoid(zt)
                y = tl.sum(h_t * Ct[None, :], axis=1) + D * u
                tl.store(dz_ptr + row + t, (g * y * sz * (1.0 + zt * (1.0 - sz))).to(dz_ptr.dtype.element_ty),
                         mask=cmask)
                g = g * zt * sz
            dD += g * u
            dh += g[:, None] * Ct[None, :]
            tl.store(dC_ptr + part_row + t, tl.sum(g[:, None] * h_t, axis=0), mask=nmask)
            tl.store(dB_ptr + part_row + t, tl.sum(dh * (dt * u)[:, None], axis=0), mask=nmask)
            du = g * D + dt * tl.sum(dh * Bt[None, :], axis=1)
            d_dt = tl.sum(dh * (A * decay * h_prev + u[:, None] * Bt[None, :]), axis=1) * d_soft
            dA += dh * decay * h_prev * dt[:, None]
            dbias += d_dt
            tl.store(du_ptr + row + t, du.to(du_ptr.dtype.element_ty), mask=cmask)
            tl.store(ddt_ptr + row + t, d_dt.to(ddt_ptr.dtype.element_ty), mask=cmask)
            dh = dh * decay
        tl.debug_barrier()  # the next chunk's replay overwrites the buffer
    tl.store(dh0_ptr + bt * I * N + hn, dh, mask=m2)
    tl.store(dA_ptr + bt * I * N + hn, dA, mask=m2)
    tl.store(dD_ptr + bt * I + ch, dD, mask=cmask)
    tl.store(dbias_ptr + bt * I + ch, dbias, mask=cmask)


_SCAN_BLOCK_I = 16
_SCAN_CHUNK = 64


def _scan_forward(u, delta, A, B, C, D, z, delta_bias, state):
    bt, i, seq = u.shape
    h = state.float().clone().contiguous() if state is not None else \
        torch.zeros(bt, i, A.shape[1], device=u.device, dtype=torch.float32)
    y = torch.empty_like(u)
    _scan_fwd[(bt, cdiv(i, _SCAN_BLOCK_I))](
        u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
        delta_bias if delta_bias is not None else u, h, y, i, seq, A.shape[1],
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        BI=_SCAN_BLOCK_I, BN=next_power_of_2(A.shape[1]))
    return y, h


class _SelectiveScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, state):
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, state)
        return _scan_forward(u, delta, A, B, C, D, z, delta_bias, state)

    @staticmethod
    def backward(ctx, dy, dh_last):
        u, delta, A, B, C, D, z, delta_bias, state = ctx.saved_tensors
        bt, i, seq = u.shape
        n = A.shape[1]
        f32 = dict(device=u.device, dtype=torch.float32)
        n_blocks, n_chunks = cdiv(i, _SCAN_BLOCK_I), cdiv(seq, _SCAN_CHUNK)
        h0 = state.float().contiguous() if state is not None else torch.zeros(bt, i, n, **f32)
        dh_last = dh_last.float().contiguous() if dh_last is not None else torch.zeros(bt, i, n, **f32)
        du, ddelta = torch.empty_like(u), torch.empty_like(delta)
        dz = torch.empty_like(z) if z is not None else None
        dB = torch.zeros(bt, n_blocks, n, seq, **f32)  # per channel-block partials
        dC = torch.zeros(bt, n_blocks, n, seq, **f32)
        dA, dh0 = torch.zeros(bt, i, n, **f32), torch.empty(bt, i, n, **f32)
        dD, dbias = torch.zeros(bt, i, **f32), torch.zeros(bt, i, **f32)
        ckpt = torch.empty(bt, n_chunks, i, n, **f32)
        hbuf = torch.empty(bt, _SCAN_CHUNK, i, n, **f32)
        _scan_bwd[(bt, n_blocks)](
            u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
            delta_bias if delta_bias is not None else u, h0, dy.contiguous(), dh_last, ckpt, hbuf,
            du, ddelta, dz if dz is not None else du, dA, dB, dC, dD, dbias, dh0, i, seq, n, n_chunks,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            T=_SCAN_CHUNK, BI=_SCAN_BLOCK_I, BN=next_power_of_2(n))
        return (du, ddelta, dA.sum(0).to(A.dtype), dB.sum(1).to(B.dtype), dC.sum(1).to(C.dtype),
                dD.sum(0).to(D.dtype) if D is not None else None, dz,
                dbias.sum(0).to(delta_bias.dtype) if delta_bias is not None else None,
                dh0.to(state.dtype) if state is not None else None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, state=None):
    """Same contract as ``selective_scan_reference``; the state is updated in a new tensor.
    Differentiable in every tensor input (and through the returned state)."""
    u, delta, B, C = u.contiguous(), delta.contiguous(), B.contiguous(), C.contiguous()
    A = A.float().contiguous()
    z = z.contiguous() if z is not None else None
    args = (u, delta, A, B, C, D, z, delta_bias, state)
    if _wants_grad(*args):
        return _SelectiveScanFn.apply(*args)
    return _scan_forward(*args)
