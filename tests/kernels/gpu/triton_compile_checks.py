"""Compiles the Triton kernels for an H200 (sm_90) down to a cubin, with no GPU: the checks
the interpreter cannot make (front end and type rules of the installed Triton's compiler, layouts,
ptxas). Run by test_triton_compile.py in a subprocess (its own Triton cache); prints one line
per variant and exits non-zero when any fails.

The variants are those a GPU run meets: bf16 (and fp16/fp32) caches, SmolLM2-135M's heads
(9 over 3, head dim 64) and Llama-3-8B's (32 over 8, head dim 128), one and several
partitions. Pointers and strides carry the divisibility-by-16 hints the launcher gives
aligned tensors, except the arguments the kernels exempt from that specialisation.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tokenloom.kernels.gpu.triton_attention as ta
import tokenloom.kernels.gpu.triton_fused as tf

TARGET = GPUTarget("cuda", 90, 32)
UNALIGNED = {"tables_ptr", "lens_ptr", "stride_tb", "stride_ob", "stride_oh", "stride_lb",
             "stride_lh", "stride_pb", "stride_ph", "scale", "eps", "n_cols", "window",
             "softcap"}


def compile_variant(fn, types: dict, constexprs: dict, num_warps: int) -> int:
    """Compile one variant; returns the cubin's size."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in types if n not in UNALIGNED and n not in constexprs}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    return len(kernel.asm["cubin"])


def variants():
    for dt, g, d, direct in [("bf16", 3, 64, False), ("bf16", 4, 128, True),
                             ("bf16", 4, 128, False), ("fp16", 4, 128, False),
                             ("fp32", 3, 64, True)]:
        p = "*" + dt
        types = dict(q_ptr=p, k_ptr=p, v_ptr=p, tables_ptr="*i64", lens_ptr="*i64",
                     out_ptr=p if direct else "*fp32", lse_ptr=p if direct else "*fp32",
                     scale="fp32", window="i32", softcap="fp32")
        types.update({s: "i32" for s in ["stride_qb", "stride_qh", "stride_kb", "stride_ks",
                                         "stride_kh", "stride_tb", "stride_ob", "stride_oh",
                                         "stride_os", "stride_lb", "stride_lh"]})
        yield (f"decode_partition {dt} G{g} D{d} direct={direct}", ta._decode_partition, types,
               dict(G=g, BLOCK_G=16, HEAD_DIM=d, BLOCK_SIZE=16, BLOCK_N=64, PARTITION=512,
                    DIRECT=direct, DOT_FP32=False), 4)
    types = dict(part_ptr="*fp32", lse_ptr="*fp32", lens_ptr="*i64", out_ptr="*bf16",
                 window="i32")
    types.update({s: "i32" for s in ["stride_pb", "stride_ph", "stride_ps", "stride_lb",
                                     "stride_lh", "stride_ob", "stride_oh"]})
    yield ("decode_reduce bf16 D128", ta._decode_reduce, types,
           dict(HEAD_DIM=128, PARTITION=512, CHUNK=ta.REDUCE_CHUNK), 4)
    yield ("store_kv bf16 row 1024", ta._store_kv,
           dict(key_ptr="*bf16", value_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16",
                slots_ptr="*i64", stride_k="i32", stride_v="i32"), dict(ROW=1024, BLOCK=1024), 4)
    for dt, n, res in [("bf16", 4096, True), ("fp32", 576, False)]:
        p = "*" + dt
        yield (f"rms_norm {dt} {n} residual={res}", tf._rms_norm,
               dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, stride_x="i32", stride_r="i32",
                    stride_o="i32", n_cols="i32", eps="fp32"),
               dict(HAS_RESIDUAL=res, BLOCK=triton.next_power_of_2(n)), 4)
    yield ("silu_mul bf16", tf._silu_mul,
           dict(gu_ptr="*bf16", out_ptr="*bf16", stride_gu="i32", stride_o="i32", n_cols="i32"),
           dict(BLOCK=1024), 4)
    for h, kvh, d, store in [(32, 8, 128, True), (9, 3, 64, False)]:
        types = dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
                     slots_ptr="*i64" if store else "*bf16", q_ptr="*bf16", k_ptr="*bf16",
                     kc_ptr="*bf16", vc_ptr="*bf16", stride_qkv="i32", stride_cos="i32",
                     stride_q="i32", stride_k="i32")
        yield (f"rope_store bf16 H{h} KVH{kvh} D{d} store={store}", tf._rope_store, types,
               dict(Q_HEADS=h, KV_HEADS=kvh, HEAD_DIM=d, STORE=store), 1)


def main() -> int:
    failed = 0
    for label, fn, types, constexprs, num_warps in variants():
        try:
            size = compile_variant(fn, types, constexprs, num_warps)
            ok = size > 0
            print(f"{'ok' if ok else 'FAIL'} {label}: cubin {size} bytes")
        except Exception as e:  # report every variant, not only the first failure
            ok = False
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}")
        failed += not ok
    print(f"triton {triton.__version__}, sm_90: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
