"""Quantized KV cache storage: 1-byte K/V with a scale per token and KV head.

A layer's K (or V) cache in a quantized mode is a ``QuantizedCache``: the values in a
1-byte format ([num_blocks, block_size, kv_heads, head_dim]) and one fp32 scale per
(block, slot, kv head) ([num_blocks, block_size, kv_heads]), stored in the block beside
its values; a value reads back as ``stored * scale``.

Scales are computed when a row is written, from the values written, so no offline
calibration exists to go missing (the failure behind TensorRT-LLM #16916). Why a scale per
token and not one per block: a block fills over many steps, so a per-block scale has to
grow as larger rows arrive and re-quantize the rows already in the block; the block's
bytes then depend on how its tokens were split into steps, and greedy output changed with
the chunk size (measured on the default model: 2 of the 8 parity prompts diverged between
a whole prefill and 64-token chunks). With a scale per row a row's bytes depend only on the
row, so every scheduling path stores the same cache. The cost is the scale itself: 4
bytes per 64 values at head dim 64 (int8 K/V take 3.76x less memory than fp32, not 4x).

Formats: int8 (symmetric, 127 levels a side), fp8 e4m3 (max 448) and fp8 e5m2 (max 57344).
The scale maps the row's absmax (per KV head) onto the format's largest value.

A layer can be *promoted* (the runtime check found its quantization too lossy): it then
keeps a model-dtype working copy (``full``) that every new write fills exactly and every
read uses, while the 1-byte form stays the canonical one that swap, the KV tiers and
transfers move (blocks restored into a promoted layer are dequantized into ``full``).
"""

from __future__ import annotations

import dataclasses

import torch

KV_DTYPES = ("auto", "bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2")
# cache.kv_dtype's 2-byte storage dtypes (plain floats, no scales: KVCache holds them as a
# pool of that dtype, not as QuantizedCaches).
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class KVFormat:
    name: str
    dtype: torch.dtype
    qmax: float
    code: int          # the C++ kernel's format id

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 values already divided by their scale -> stored bytes (uint8)."""
        if self.dtype == torch.int8:
            return x.round().clamp_(-self.qmax, self.qmax).to(torch.int8).view(torch.uint8)
        return x.clamp(-self.qmax, self.qmax).to(self.dtype).view(torch.uint8)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored bytes (uint8) -> fp32 values (before the scale)."""
        return raw.view(self.dtype).to(torch.float32)


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 1),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 2),
}


def kv_format(name: str) -> KVFormat | None:
    """The 1-byte format of a `cache.k_dtype`/`v_dtype` value; None for "auto" (the model
    dtype) and the 2-byte ones (kv_storage_dtype)."""
    return None if name == "auto" or name in HALF_DTYPES else FORMATS[name]


def kv_storage_dtype(cache_cfg, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV pool's values: bf16 / fp16 when cache.kv_dtype asks for it, uint8
    for a 1-byte format, else the model's."""
    if cache_cfg.kv_dtype in HALF_DTYPES:
        return HALF_DTYPES[cache_cfg.kv_dtype]
    return torch.uint8 if cache_cfg.kv_quantized else model_dtype


def kv_dtype_name(cache_cfg) -> str:
    """How a `[cache]` section stores K/V, in one word: "auto", "int8", "fp8_e4m3/int8"."""
    k, v = cache_cfg.side_dtype("k"), cache_cfg.side_dtype("v")
    return k if k == v else f"{k}/{v}"


def resolve_rotation(cache_cfg, head_dim: int) -> str:
    """`cache.kv_rotation` for this model: "hadamard" or "none". "auto" rotates a quantized
    cache whose head dim is a power of two (measured to help every format: see
    docs/kv-quantization.md)."""
    pow2 = head_dim >= 1 and head_dim & (head_dim - 1) == 0
    if cache_cfg.kv_rotation == "auto":
        return "hadamard" if cache_cfg.kv_quantized and pow2 else "none"
    if cache_cfg.kv_rotation == "hadamard" and not pow2:
        from tokenloom.config.schema import ConfigError
        raise ConfigError(f"cache.kv_rotation 'hadamard' needs a power-of-two head dim; this "
                          f"model's is {head_dim} (use 'auto' or 'none')",
                          key="cache.kv_rotation")
    return cache_cfg.kv_rotation


@dataclasses.dataclass
class QuantizedCache:
    """One layer's K or V cache in a 1-byte format (see the module docstring)."""
    # [num_blocks, block_size, kv_heads, head_dim] uint8: the bytes of fmt.dtype values
    # (bytes, because torch has no CPU index copies for the fp8 dtypes)
    data: torch.Tensor
    scale: torch.Tensor       # [num_blocks, block_size, kv_heads] fp32
    fmt: KVFormat
    out_dtype: torch.dtype    # the model dtype reads dequantize to
    full: torch.Tensor | None = None   # promoted: the model-dtype working copy

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def promoted(self) -> bool:
        return self.full is not None

    def dequantize_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[..., n] block ids -> [..., n, block_size, kv_heads, head_dim] in out_dtype."""
        if self.full is not None:
            return self.full.index_select(0, block_ids.reshape(-1)).view(
                *block_ids.shape, *self.data.shape[1:])
        flat = block_ids.reshape(-1)
        vals = self.fmt.decode(self.data.index_select(0, flat))
        vals.mul_(self.scale.index_select(0, flat)[..., None])
        return vals.to(self.out_dtype).view(*block_ids.shape, *self.data.shape[1:])

    def promote(self) -> int:
        """Keep a model-dtype copy from now on (existing blocks dequantized into it).
        Returns the bytes it takes."""
        if self.full is None:
            ids = torch.arange(self.data.shape[0], device=self.data.device)
            self.full = self.dequantize_blocks(ids).contiguous()
        return self.full.numel() * self.full.element_size()

    def refresh(self, block_ids: torch.Tensor) -> None:
        """Blocks written in 1-byte form from outside (swap-in, a tier restore): bring the
        promoted copy up to date."""
        if self.full is not None and block_ids.numel():
            saved, self.full = self.full, None
            try:
                saved[block_ids] = self.dequantize_blocks(block_ids)
            finally:
                self.full = saved

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]
        self.scale[dst] = self.scale[src]
        if self.full is not None:
            self.full[dst] = self.full[src]

    def store(self, x: torch.Tensor, slots: torch.Tensor, has_skip: bool = False) -> None:
        """Write x [T, kv_heads, head_dim] into `slots` (slot < 0: skipped)."""
        if has_skip:
            keep = slots >= 0
            slots, x = slots[keep], x[keep]
        if slots.numel() == 0:
            return
        quantize_into(self, x, slots)
        if self.full is not None:
            kvh, d = x.shape[1], x.shape[2]
            self.full.view(-1, kvh, d).index_copy_(0, slots, x.to(self.full.dtype))


def quantize_into(cache: QuantizedCache, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize rows x [T, kv_heads, head_dim] with a scale per row and head, and write
    values and scales into `slots` (all >= 0). No host sync: a captured graph can run it."""
    kvh, d = x.shape[1], x.shape[2]
    xf = x.to(torch.float32)
    scale = xf.abs().amax(-1) / cache.fmt.qmax                          # [T, kvh]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    cache.data.view(-1, kvh, d).index_copy_(0, slots, cache.fmt.encode(xf / safe[..., None]))
    cache.scale.view(-1, kvh).index_copy_(0, slots, scale)


def hadamard(d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of size d (a power of two): every output channel
    mixes every input channel with equal weight, so one outlier channel is spread evenly."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / d ** 0.5).to(dtype=dtype, device=device)


def make_caches(pool: torch.Tensor, scales: torch.Tensor, k_fmt: KVFormat, v_fmt: KVFormat,
                out_dtype: torch.dtype) -> tuple[list[QuantizedCache], list[QuantizedCache]]:
    """Per-layer K and V caches over one uint8 pool [layers, 2, blocks, bs, kvh, d] and its
    scales [layers, 2, blocks, bs, kvh]."""
    keys = [QuantizedCache(pool[i, 0], scales[i, 0], k_fmt, out_dtype)
            for i in range(pool.shape[0])]
    values = [QuantizedCache(pool[i, 1], scales[i, 1], v_fmt, out_dtype)
              for i in range(pool.shape[0])]
    return keys, values


def quantized_bytes_per_block(num_layers: int, block_size: int, kv_heads: int,
                              head_dim: int) -> int:
    """1-byte values plus the fp32 scales of one block, every layer's K and V."""
    return num_layers * 2 * block_size * kv_heads * (head_dim + 4)
