"""Weights in 32-weight blocks, the way GGUF stores them, for the CPU block kernels
(csrc/block_gemm_cpu.cpp).

q4 (GGUF Q4_1; Q4_0 converts exactly): per block an fp16 scale d, an fp16 min m and 32
4-bit codes, w = d * q + m. Byte j of a block holds code j in its low nibble and code j + 16
in its high nibble, as in GGUF, so a file's blocks are used as they are.
q8 (GGUF Q8_0): per block an fp16 scale d and 32 int8 codes, w = d * q.

Everything here is plain torch on whole tensors: quantizing a dense weight, reading a GGUF
tensor's raw bytes, and the reference dequantization the kernels are tested against.
"""

from __future__ import annotations

import dataclasses

import torch

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class Q4Blocks:
    qs: torch.Tensor   # [N, K/2] uint8
    d: torch.Tensor    # [N, K/32] float16
    m: torch.Tensor    # [N, K/32] float16

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def rows(self, index: torch.Tensor) -> "Q4Blocks":
        return Q4Blocks(self.qs[index].contiguous(), self.d[index].contiguous(),
                        self.m[index].contiguous())


@dataclasses.dataclass(frozen=True)
class Q8Blocks:
    qs: torch.Tensor   # [N, K] int8
    d: torch.Tensor    # [N, K/32] float16

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qs.shape)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.d.numel() * 2

    def rows(self, index: torch.Tensor) -> "Q8Blocks":
        return Q8Blocks(self.qs[index].contiguous(), self.d[index].contiguous())


Blocks = Q4Blocks | Q8Blocks


def blockable(weight_shape) -> bool:
    """Whether a [N, K] weight can be stored in blocks (K a multiple of 32)."""
    return len(weight_shape) == 2 and weight_shape[1] % BLOCK == 0 and weight_shape[1] > 0


def _grouped(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"a block-quantized weight needs a width that is a multiple of {BLOCK} "
                         f"(got {k})")
    return w.detach().float().reshape(n, k // BLOCK, BLOCK)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, nb, 32] in 0..15 -> [N, nb * 16] uint8 (low nibble j, high nibble j + 16)."""
    c = codes.to(torch.uint8)
    packed = c[..., :16] | (c[..., 16:] << 4)
    return packed.reshape(codes.shape[0], -1).contiguous()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, nb * 16] uint8 -> codes [N, nb, 32]."""
    b = qs.reshape(qs.shape[0], -1, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def quantize_q4(w: torch.Tensor) -> Q4Blocks:
    """Scale + min per 32 weights (Q4_1). The codes are rounded against the stored (fp16)
    scale and min, so the error is what the kernel will compute with."""
    g = _grouped(w)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d16 = ((hi - lo) / 15).to(torch.float16)
    m16 = lo.to(torch.float16)
    d, m = d16.float(), m16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((g - m[..., None]) / safe[..., None]).clamp_(0, 15)
    codes = torch.where((d > 0)[..., None], codes, torch.zeros_like(codes))
    return Q4Blocks(_pack_nibbles(codes), d16.contiguous(), m16.contiguous())


def quantize_q8(w: torch.Tensor) -> Q8Blocks:
    """Symmetric scale per 32 weights (Q8_0)."""
    g = _grouped(w)
    d16 = (g.abs().amax(dim=-1) / 127).to(torch.float16)
    d = d16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round(g / safe[..., None]).clamp_(-127, 127)
    return Q8Blocks(codes.to(torch.int8).reshape(w.shape).contiguous(), d16.contiguous())


def dequantize(b: Blocks) -> torch.Tensor:
    """The fp32 weight the blocks stand for (the reference the kernels are tested against)."""
    if isinstance(b, Q4Blocks):
        codes = _unpack_nibbles(b.qs).float()
        w = codes * b.d.float()[..., None] + b.m.float()[..., None]
    else:
        n, k = b.qs.shape
        w = b.qs.float().reshape(n, k // BLOCK, BLOCK) * b.d.float()[..., None]
    return w.reshape(b.shape[0], -1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the block kernels multiply by: each row of x in int8 blocks of 32 with scale
    max|x| / 127, returned dequantized (fp32), for references in tests."""
    g = _grouped(x)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127)).reshape(x.shape)


def pack_groups(qs: torch.Tensor) -> torch.Tensor:
    """The layout of the packed block kernels (`q4_gemm_packed`, `q8_gemm_packed` in
    csrc/block_gemm_cpu.cpp): each row's leading groups of 16 blocks with byte j of block i
    moved to (j // 4) * 64 + i * 4 + j % 4 of its group, so that one 64-byte load holds 4
    codes of each of 16 blocks; the blocks after the last whole group stay as they are.
    The same bytes, so the same size."""
    rows, width = qs.shape
    per_block = 32 if qs.dtype == torch.int8 else 16     # Q8_0 codes, or Q4 nibble pairs
    head = width // (16 * per_block) * 16 * per_block
    if head == 0:
        return qs.contiguous()
    groups = (qs[:, :head].reshape(rows, head // (16 * per_block), 16, per_block // 4, 4)
              .permute(0, 1, 3, 2, 4).reshape(rows, head))
    return torch.cat([groups, qs[:, head:]], dim=1).contiguous()


def unpack_groups(qs: torch.Tensor) -> torch.Tensor:
    """pack_groups undone."""
    rows, width = qs.shape
    per_block = 32 if qs.dtype == torch.int8 else 16
    head = width // (16 * per_block) * 16 * per_block
    if head == 0:
        return qs.contiguous()
    groups = (qs[:, :head].reshape(rows, head // (16 * per_block), per_block // 4, 16, 4)
              .permute(0, 1, 3, 2, 4).reshape(rows, head))
    return torch.cat([groups, qs[:, head:]], dim=1).contiguous()


def concat(parts: list[Blocks]) -> Blocks:
    """Row-wise concatenation (a fused QKV or gate/up projection), exact."""
    if all(isinstance(p, Q4Blocks) for p in parts):
        return Q4Blocks(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]))
    if all(isinstance(p, Q8Blocks) for p in parts):
        return Q8Blocks(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]))
    raise ValueError("cannot fuse projections stored in different block formats")


# -- GGUF's raw blocks ---------------------------------------------------------------------
# GGUF block records (ggml-common.h): Q4_0 = d:f16, qs[16]; Q4_1 = d:f16, m:f16, qs[16];
# Q8_0 = d:f16, qs[32] int8.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def from_gguf(kind: str, raw: torch.Tensor, rows: int, cols: int) -> Blocks:
    """A GGUF tensor's bytes ([rows, cols/32 * record] uint8) as blocks, without requantizing.
    Q4_0's w = d (q - 8) becomes d q + m with m = -8 d: exact (a power-of-two multiple)."""
    if kind not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF block type {kind!r} is not one of {sorted(GGUF_BLOCK_BYTES)}")
    if cols % BLOCK:
        raise ValueError(f"GGUF tensor width {cols} is not a multiple of {BLOCK}")
    nb = cols // BLOCK
    rec = raw.reshape(rows, nb, GGUF_BLOCK_BYTES[kind]).contiguous()

    def f16(lo: int) -> torch.Tensor:
        return rec[..., lo:lo + 2].contiguous().view(torch.float16).reshape(rows, nb)

    if kind == "Q8_0":
        qs = rec[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        return Q8Blocks(qs.contiguous(), f16(0).contiguous())
    d = f16(0)
    if kind == "Q4_1":
        m, qs = f16(2), rec[..., 4:]
    else:
        m, qs = (d.float() * -8).to(torch.float16), rec[..., 2:]
    return Q4Blocks(qs.reshape(rows, nb * 16).contiguous(), d.contiguous(), m.contiguous())
