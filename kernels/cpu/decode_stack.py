"""A CPU decode step's decoder layers in one C++ call (csrc/decode_stack_cpu.cpp).

At one decode row a small model's step is mostly Python: the default model in q4 spent
~11 ms of a 27 ms forward in its projections, the rest in ~30 op calls a layer and the
module calls around them. The stack runs the same projection kernels and the same decode
attention through the dispatcher, and the small ops as row loops, without returning to
Python between layers.

It serves eager steps whose projections all run a kernel it knows at that row count
(`KINDS`) on an fp32 or bf16 model with a plain KV pool in the model's dtype and the C++
decode attention (bf16 rounds where the module forward's torch ops round), or on an fp32
model whose pool is bf16 or fp16 (cache.kv_dtype; K/V rounded as they are stored). Prefill chunks
ride along when the model's prefill attention is the C++ kernel: each chunk attends to its
context through its block table (the paged kernel), after the step's K/V are stored. A
mixed step (16 decodes + a 64-token chunk) spent ~6 ms of Python between its kernels in
the module forward. Any other step (an adapter row, a quantized KV cache, the runtime KV
check, a KV rotation, a compiled program, SDPA prefill attention) takes the module
forward, unchanged.

A decode-only step whose kernels all have a team body (csrc/team.h: the packed q4 / q8
blocks, small_gemm, the tile kernels' FMA body, the vector decode attention) runs its
layers in one OpenMP parallel region instead of a fork and join per kernel: the same tiles
and sums, bit-identical, ~0.6-1 ms less per step at batch 1 on 2 cores (docs/cpu.md, "One
OpenMP team per decode step").
"""

from __future__ import annotations

import torch

from tokenloom.arith import cdiv
from tokenloom.kernels.cpu import kernel_set
from tokenloom.kernels.cpu import linear as cpu_linear
from tokenloom.startup_log import startup_log as log

# The projection kernels (kernels/cpu/kernel_set.py names) the stack can call, by its codes.
(Q4, Q8, SMALL, DENSE, ONEDNN, STRIPS, INT8PACK, TILE, Q4_PACKED, Q8_PACKED, TILE_INT8,
 TILE_F32) = range(12)
KINDS = {"block_gemm", "small_gemm", "small_gemm_int8", "small_gemm_strips",
         "small_gemm_strips_int8", "mkl", "copy_mkl", "onednn", "copy_onednn",
         "int8pack_bf16", "tile_gemm", "copy_tile_bf16", "tile_gemm_int8", "tile_gemm_f32"}
ACTIVATIONS = (torch.float32, torch.bfloat16)
# Pools the stack reads under fp32 activations besides fp32 (cache.kv_dtype bf16 / fp16).
HALF_POOLS = (torch.bfloat16, torch.float16)
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

_module = None
_failed: str | None = None


def module():
    """The built extension, or None with the reason logged (no compiler)."""
    global _module, _failed
    if _module is None and _failed is None:
        try:
            from tokenloom.kernels.cpu.cpp_build import build
            _module = build("tokenloom_decode_stack_cpu", "decode_stack_cpu.cpp")
        except Exception as e:
            _failed = f"{type(e).__name__}: {e}"
            log.info("C++ decode stack unavailable; module forward", reason=_failed)
    return _module


def unsupported(spec) -> str | None:
    """The first option of the model's family the C++ stack does not implement (its
    layers then run the module forward), or None."""
    # (Qwen3's q/k norms run in the stack; Gemma's scale in fp32 first, an order it lacks)
    checks = (("Gemma's q/k norms", spec.qk_norm and spec.norm_offset != 0),
              ("an output-projection bias", spec.o_bias),
              (f"the {spec.activation} activation", spec.activation != "silu"),
              ("sandwich norms", spec.sandwich_norms),
              ("sliding-window layers", spec.has_sliding_layers),
              ("attention soft-capping", spec.attn_logit_softcap is not None),
              ("a second RoPE table", spec.rope_local is not None))
    return next((what for what, present in checks if present), None)


def install(model) -> bool:
    """Give an fp32 or bf16 CPU model its decode stacks (the C++ decode attention must be
    loaded: the stack calls its operator)."""
    if model.embed_tokens.weight.dtype not in ACTIVATIONS or module() is None:
        return False
    missing = unsupported(model.spec)
    if missing is not None:
        log.info(f"C++ decode stack off: it does not implement {missing} "
                 f"({model.spec.family}); decode steps run the module forward",
                 family=model.spec.family, reason=missing)
        return False
    model.decode_stacks = DecodeStacks(model)
    return True


def _args(lin, name: str) -> tuple[int, list[torch.Tensor]] | None:
    """(kind, the operator's tensors after x) for projection `lin` running kernel `name`."""
    if not isinstance(lin, cpu_linear.CpuLinear):
        return (DENSE, [lin.weight] if lin.bias is None else [lin.weight, lin.bias])
    k = lin.kernels
    bias = k.empty if k.bias is None else k.bias
    if name == "block_gemm":
        if k.storage == kernel_set.Q4:
            return Q4_PACKED if k.grouped else Q4, [k.qs, k.d, k.m, bias]
        return Q8_PACKED if k.grouped else Q8, [k.qs, k.d, bias]
    if name == "small_gemm":
        return SMALL, [k.w, k.empty, bias]
    if name == "small_gemm_int8":
        return SMALL, [k.q, k.scale, bias]
    if name == "small_gemm_strips":
        return STRIPS, [k.w, k.empty, bias]
    if name == "small_gemm_strips_int8":
        return STRIPS, [k.q, k.scale, bias]
    if name in ("mkl", "copy_mkl"):
        return DENSE, [k.w] if k.bias is None else [k.w, k.bias]
    if name == "int8pack_bf16":
        return INT8PACK, [k.q, k.scale16, bias]
    if name in ("tile_gemm", "copy_tile_bf16"):
        return TILE, [k.tiles, bias]
    if name == "tile_gemm_int8":
        return TILE_INT8, [k.tiles8, k.scale, bias]
    if name == "tile_gemm_f32":
        return TILE_F32, [k.tiles32, bias]
    if name in ("onednn", "copy_onednn"):
        return ONEDNN, [k.packed] if k.bias is None else [k.packed, k.bias]
    return None


def _enable_team(stack) -> bool:
    """Let `stack` run its decode-only steps in one OpenMP team (csrc/team.h) where its
    kernels allow: every projection packed q4 / q8 blocks (fp32 activations), rows
    (small_gemm, small_gemm_strips) or an FMA tile kernel, and the vector decode attention.
    Bit-identical to the per-call path, without a fork and join of the team per kernel."""
    from tokenloom.kernels.cpu.attention import load_cpu_decode_kernel

    attention = load_cpu_decode_kernel()
    if attention is None:
        return False
    factories = [m.team_factory() if m is not None else None
                 for m in (kernel_set.block_gemm_module(), kernel_set.small_gemm_module(),
                           kernel_set.tile_gemm_module())]
    return bool(stack.enable_team(*factories, attention.team_factory()))


class DecodeStacks:
    """The model's C++ stacks, one per combination of projection kernels (the kernels are
    chosen per row count, so a batch of 1 and one of 12 may need different ones)."""

    def __init__(self, model):
        self.model = model
        self._by_rows: dict[int, object] = {}
        self._by_kernels: dict[tuple[str, ...], object] = {}
        # Per combination of kernels: whether its decode-only steps run in one OpenMP team.
        self.team_kernels: dict[tuple[str, ...], bool] = {}
        self.steps = 0   # decode steps served (tests and stats)

    def usable(self, meta, kv) -> bool:
        """Whether this step may run on a stack (see the module docstring)."""
        if meta.lora is not None or torch.compiler.is_compiling():
            return False
        attn = self.model.layers[0].self_attn
        if meta.prefills and getattr(attn.prefill_fn, "paged", None) is None:
            return False
        pool, act = kv.pool, self.model.embed_tokens.weight.dtype
        if pool is None or kv.scales is not None or not (
                pool.dtype == act or (act == torch.float32 and pool.dtype in HALF_POOLS)):
            return False
        from tokenloom.kernels.cpu.attention import paged_decode_cpu
        return (attn.kv_check is None and attn.kv_rotation is None
                and attn.decode_fn is paged_decode_cpu and attn.rope_store_fn is None
                and attn.store_fn is None)

    def for_rows(self, rows: int):
        """The stack for a step of `rows` rows, or None (a kernel it cannot call)."""
        if rows not in self._by_rows:
            self._by_rows[rows] = self._build(rows)
        return self._by_rows[rows]

    def _build(self, rows: int):
        layers = self.model.layers
        first = [layers[0].get_submodule(n) for n in PROJECTIONS]
        kernels = tuple(lin.kernel_for(rows) if isinstance(lin, cpu_linear.CpuLinear)
                        else "dense" for lin in first)
        if kernels in self._by_kernels:
            return self._by_kernels[kernels]
        norms, kinds, args = [], [], []
        for layer in layers:
            norms += [layer.input_layernorm.weight.detach(),
                      layer.post_attention_layernorm.weight.detach()]
            for n, name in zip(PROJECTIONS, kernels):
                found = _args(layer.get_submodule(n), name)
                if found is None:
                    self._by_kernels[kernels] = None
                    return None
                kinds.append(found[0])
                args.append([t.detach() for t in found[1]])
        attn, spec = layers[0].self_attn, self.model.spec
        try:
            stack = module().DecodeStack(norms, kinds, args, attn.num_heads,
                                         attn.num_kv_heads, attn.head_dim,
                                         float(spec.rms_norm_eps), float(attn.scale))
        except RuntimeError as e:   # an operator missing from this build: the module forward
            log.warning("C++ decode stack unavailable for these kernels; module forward",
                        kernels=list(kernels), reason=str(e))
            stack = None
        if stack is not None and spec.rope.rotary_dim not in (0, spec.head_dim):
            stack.set_rotary_dim(spec.rope.rotary_dim)
        if stack is not None and spec.qk_norm:
            stack.set_qk_norms([n.weight.detach() for layer in layers
                                for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)])
        if stack is not None:
            self.team_kernels[kernels] = _enable_team(stack)
        self._by_kernels[kernels] = stack
        return stack

    def run(self, stack, input_ids: torch.Tensor, positions: torch.Tensor, kv,
            meta) -> torch.Tensor:
        """The residual stream after the last layer, [rows, hidden]."""
        model = self.model
        h = model.embed(input_ids)
        # (LongRoPE: a token's row says which factors rotate it, as in the module forward)
        cos, sin = model.rope.lookup(positions if meta.rope_rows is None else meta.rope_rows)
        self.steps += 1
        bs = kv.pool.shape[3]
        segs = torch.tensor([[s.query_start, s.query_len, s.start_pos] for s in meta.prefills],
                            dtype=torch.int64).reshape(-1, 3)
        tables = [s.block_table[:cdiv(s.context_len, bs)] for s in meta.prefills]
        return stack.run(h, cos, sin, kv.pool, meta.slot_mapping, meta.decode_block_tables,
                         meta.decode_context_lens, segs, tables)
