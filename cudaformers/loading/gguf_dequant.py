"""Dequantize GGML block formats in torch, vectorised over blocks, on whatever device the bytes live on.

Each format stores a tensor's rows as fixed-size blocks of bytes. A function here takes those bytes as a
``uint8`` tensor ``[n_blocks, block_bytes]`` and returns ``float32 [n_blocks, block_size]``; the
arithmetic follows ggml's reference order (scale first, then offset) in float32, so the result matches
``gguf.quants.dequantize`` bit for bit. Layouts are those of ggml-common.h; ``QK_K`` super-blocks hold
256 values.
"""

from __future__ import annotations

import torch

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields [n, 2k] -> float32 [n, k]."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, ..., m] bytes -> [n, ..., 2, m]: low nibbles first, then high nibbles (ggml's order)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(q: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """[n, ..., m] bytes -> [n, ..., len(shifts), m]: the field at each shift."""
    shift = torch.tensor(list(shifts), dtype=torch.uint8, device=q.device).view(-1, 1)
    return (q.unsqueeze(-2) >> shift) & mask


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | qs: int8[32]
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | qs: 16 bytes, value j in the low nibble of byte j, value j+16 in its high nibble; offset 8
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).flatten(1).to(torch.int8) - 8
    return d * q.float()


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | m: f16 | qs: 16 bytes as in Q4_0, unsigned
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).flatten(1).float()
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 fifth bits: a little-endian uint32 [n, 4 bytes], bit j for value j -> [n, 32]."""
    return _bits(qh, range(8), 1).transpose(1, 2).flatten(1) << 4


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | qh: 32 fifth bits | qs: 16 bytes as in Q4_0; offset 16
    d = _f16(blocks[:, :2])
    q = (_nibbles(blocks[:, 6:]).flatten(1) | _q5_high(blocks[:, 2:6])).to(torch.int8) - 16
    return d * q.float()


def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | m: f16 | qh: 32 fifth bits | qs: 16 bytes; unsigned
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = (_nibbles(blocks[:, 8:]).flatten(1) | _q5_high(blocks[:, 4:8])).float()
    return d * q + m


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 6-bit scales and mins of the 8 sub-blocks, packed in 12 bytes -> two [n, 8] float32.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scale/min 4-7, whose top 2 bits sit in the spare high bits of bytes 0-3 / 4-7.
    """
    lo, hi, mix = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)), dim=1)
    mn = torch.cat((hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # d, dmin: f16 | scales: 12 bytes | qs: 128 bytes, 4 chunks of 32 bytes = sub-blocks (2i, 2i+1)
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks[:, 0:2]) * sc).view(n, 8, 1)
    dm = (_f16(blocks[:, 2:4]) * mn).view(n, 8, 1)
    q = _nibbles(blocks[:, 16:].view(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dm).view(n, QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # d, dmin: f16 | scales: 12 bytes | qh: 32 bytes, bit k of byte l = fifth bit of value l of
    # sub-block k | qs: 128 bytes as in Q4_K
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks[:, 0:2]) * sc).view(n, 8, 1)
    dm = (_f16(blocks[:, 2:4]) * mn).view(n, 8, 1)
    low = _nibbles(blocks[:, 48:].view(n, 4, 32)).reshape(n, 8, 32)
    high = _bits(blocks[:, 16:48], range(8), 1)
    q = (low | (high << 4)).float()
    return (d * q - dm).view(n, QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # ql: 128 bytes (low 4 bits) | qh: 64 bytes (high 2 bits) | scales: int8[16] | d: f16.
    # Each half of 128 values takes 64 ql bytes (low nibbles -> values 0-63, high -> 64-127) and 32 qh
    # bytes (bit pairs 0,2,4,6 -> values 0-31, 32-63, 64-95, 96-127); offset 32; one scale per 16 values.
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128].view(n, 2, 64)).reshape(n, 2, 4, 32)
    qh = _bits(blocks[:, 128:192].view(n, 2, 32), range(0, 8, 2), 3)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks[:, 208:210]) * scales).view(n, 16, 1)
    return (d * q).view(n, QK_K)


# ggml type name -> (values per block, bytes per block, function)
BLOCK_FORMATS = {
    "Q8_0": (32, 34, dequant_q8_0),
    "Q4_0": (32, 18, dequant_q4_0),
    "Q4_1": (32, 20, dequant_q4_1),
    "Q5_0": (32, 22, dequant_q5_0),
    "Q5_1": (32, 24, dequant_q5_1),
    "Q4_K": (QK_K, 144, dequant_q4_k),
    "Q5_K": (QK_K, 176, dequant_q5_k),
    "Q6_K": (QK_K, 210, dequant_q6_k),
}
# Plain formats: stored as the element type itself.
PLAIN_FORMATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SUPPORTED_TYPES = tuple(PLAIN_FORMATS) + tuple(BLOCK_FORMATS)


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The bytes of one tensor (``uint8``, any device) in ggml type ``type_name`` -> ``dtype`` [*shape].

    ``shape`` is in torch order (rows last-dimension contiguous). Raises ``KeyError`` for a type with
    no entry here; the caller turns that into an error naming the tensor.
    """
    raw = raw.reshape(-1)
    if type_name in PLAIN_FORMATS:
        return raw.view(PLAIN_FORMATS[type_name]).view(shape).to(dtype)
    block_size, block_bytes, fn = BLOCK_FORMATS[type_name]
    values = fn(raw.view(-1, block_bytes))
    return values.view(shape).to(dtype)
