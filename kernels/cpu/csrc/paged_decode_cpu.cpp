// Paged-attention decode for the CPU: one query token per sequence, keys and values read
// straight from the block pool through each sequence's block table (no gathered copy).
//
// Two passes over a span of keys: scores (q . k) then the weighted sum of values; softmax
// partials in fp32 in between, merged per sequence at the end. Decode attention should be
// memory-bound: each pass prefetches one block ahead (prefetch_row).
//
// With AVX-512 and head_dim a multiple of 16 (the vector path, decode_kernel_avx512): a work
// item is a span of 64 keys of one sequence with all its heads (whole K/V rows, read front
// to back), each kv head's query heads four at a time, rows widened to fp32 in registers,
// exp on 16 lanes. (Until session 19 an item was one kv head's slice of the span: 1.1-1.3x
// slower from a cold cache.) Measured on the default model's shapes (9 heads,
// 3 kv heads, 64 dims, bf16, 30 layers, blocks scattered over a large pool) against the
// scalar loops: 300 keys 1.37 -> 0.61 ms, 1,100 keys 3.94 -> 2.35 ms. A quad with fewer
// than four heads (3 here) computes only those, and bf16 keys meet a bf16 query on
// vdpbf16ps where the CPU has AVX512-BF16: side by side, 16 sequences x 300 keys 11.06 ->
// 9.74 ms, one x 300 0.48 -> 0.41 ms, one x 1,100 1.93 -> 1.75 ms. Otherwise (the scalar
// path, decode_kernel): a span of up to 256 keys of one sequence with all its heads, so every
// key/value row ([kv_heads, head_dim], contiguous in its block) is loaded once, in order.
// A quantized cache (1-byte codes, a scale per token and kv head) takes the vector path
// too, its codes decoded as they are loaded (Code, load16), when K and V share a format;
// otherwise decode_kernel_q below, a whole sequence per item.
//
// A layer's options (kernels/attention.py): a sliding window (> 0) starts every path's keys
// at the window's first (first_visible), so a windowed decode costs its window, not its
// context; a soft-cap (> 0) caps a work item's scores in one pass before its softmax
// (softcap_scores, vec_exp.h). Without them the loops are those of the plain kernel.
//
// Built with -fopenmp (kernels/cpu/attention.py): without it at::parallel_for compiles to a plain
// loop and every sequence runs on the calling thread. (Splitting a sequence's kv heads
// across threads was measured too: no faster for a lone sequence, slower when one thread;
// splitting its context is what lets a lone long decode use both cores.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "prefill_attention.h"
#include "row_ops.h"
#include "team.h"
#include "vec_exp.h"

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// Ask for a K/V row of a later block now. Blocks sit anywhere in the pool, so the hardware
// prefetcher stalls at every block boundary; loading the row one block ahead keeps the
// next block in flight while this one is computed on (~2x on contexts that are not in the
// cache, which is every real step: each layer reads its own KV). Into L2, not L1
// (prefetcht1): a core has few L1 miss buffers, and with prefetcht0 the prefetches
// themselves stalled on them (perf: the time sat on the prefetch instructions); into L2
// the same kernel read 1.3-1.4x faster in fp32 and 1.15x in bf16 (session 19, default
// model's shapes, 30 layers, interleaved).
template <typename T>
static inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(p + i, 0, 2);
}

// Keys per work item: a sequence's context is cut into spans of this many keys, each
// computed by one thread (softmax partials: the span's max, sum and weighted values), then
// merged. A fixed span, not one derived from the thread count or the batch, so a
// sequence's result is the same whatever else is in the step and however many threads run
// (a lone 1,100-token decode spreads over every core instead of one).
constexpr int64_t kSpan = 256;

// The first key a decode query after `ctx` keys sees: with a sliding window (> 0), its last
// `window` keys only. Every path starts its loops there: the keys behind it are never read,
// nor their block-table entries (a hybrid KV layout points them at a reserved block of
// garbage, actors/kv/groups.py).
static inline int64_t first_visible(int64_t ctx, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define TL_DECODE_BF16_DOT 1
#endif
#define TL_DECODE_AVX512 1

// An element of a quantized cache (kernels/kv_quant.py) in format F (0 int8, 1 fp8 e4m3,
// 2 fp8 e5m2): one byte, decoded by load16 as it is loaded, so the vector path's passes
// run over a quantized cache unchanged (the scales are folded in by decode_item_avx512).
template <int F>
struct Code {
  static constexpr int kFmt = F;
  uint8_t bits;
};
template <typename T>
struct is_code : std::false_type {};
template <int F>
struct is_code<Code<F>> : std::true_type {};

// 16 codes -> 16 floats: decode_fp8's integer selects on 16 lanes (int8: a widening).
template <int FMT>
static inline __m512 decode16(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (FMT == 0) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  } else {
    constexpr int MANT = FMT == 1 ? 3 : 2, BIAS = FMT == 1 ? 7 : 15;
    constexpr float step = 1.0f / static_cast<float>(1 << (BIAS - 1 + MANT));
    const __m512i b = _mm512_cvtepu8_epi32(raw);
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const __m512i normal = _mm512_or_si512(
        _mm512_add_epi32(_mm512_slli_epi32(em, 23 - MANT), _mm512_set1_epi32((127 - BIAS) << 23)),
        sign);
    const __m512i sub = _mm512_or_si512(
        _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(step))), sign);
    const __mmask16 is_normal = _mm512_cmpge_epu32_mask(em, _mm512_set1_epi32(1 << MANT));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_normal, sub, normal));
  }
}

// 16 cache elements as fp32: bf16 is the top half of an fp32, fp16 converts in hardware,
// a quantized code is decoded.
template <typename T>
static inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (is_code<T>::value) {
    return decode16<T::kFmt>(reinterpret_cast<const uint8_t*>(p));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// The sums of four 16-lane vectors, in the four lanes of the result (a shuffle tree: a
// third of the instructions of four separate horizontal sums).
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // per 128-bit lane: [a0, a1, a2, a3] partial sums
  __m512 x = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, 0x44), _mm512_shuffle_ps(s0, s1, 0xEE));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
  return _mm512_castps512_ps128(x);
}

// Keys walked block by block: one division per block, not per key.
#define TL_FOR_KEYS(cache)                                                                    \
  for (int64_t t = t0; t < t1;) {                                                             \
    const int64_t tb = t % BS, te = std::min(t1, t - tb + BS);                                \
    const T* base = cache + table[t / BS] * blk_stride + off;                                 \
    const T* next = t - tb + BS < ctx ? cache + table[t / BS + 1] * blk_stride + off : nullptr; \
    for (int64_t i = tb; t < te; ++t, ++i) {                                                  \
      const T* rowp = base + i * row_stride;                                                  \
      if (next != nullptr) prefetch_row(next + i * row_stride, D);
#define TL_END_KEYS }}

// P . V for one quad of HN (<= 4) heads, their HN x NV sums in registers (D <= 64).
template <typename T, int NV, int HN>
static inline void pv_quad(const float* pq, const T* vc, const int64_t* table, int64_t ctx,
                           int64_t t0, int64_t t1, int64_t off, int64_t BS, int64_t blk_stride,
                           int64_t row_stride, float* acc) {
  constexpr int64_t D = NV * 16;
  __m512 a[HN][NV];
  for (int h = 0; h < HN; ++h)
    for (int j = 0; j < NV; ++j) a[h][j] = _mm512_setzero_ps();
  TL_FOR_KEYS(vc)
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(rowp + 16 * j);
    for (int h = 0; h < HN; ++h) {
      const __m512 p = _mm512_set1_ps(pq[(t - t0) * 4 + h]);
      for (int j = 0; j < NV; ++j) a[h][j] = _mm512_fmadd_ps(p, vv[j], a[h][j]);
    }
  TL_END_KEYS
  for (int h = 0; h < HN; ++h)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + h * D + 16 * j, a[h][j]);
}

// The scores of one key row slice (one kv head, NV vectors of 16) against that kv head's
// G query heads, stored [head quad][t][4]: the slice is widened once and kept in registers
// while every query head of the group uses it; heads go in fours (the query is zero-padded
// to a multiple of 4 heads), their four dot products summed by one shuffle tree and stored
// together. Scaled after the dot product (the same products as scaling q first, up to fp32
// rounding). QB: the query is bf16 (qb holds it), so bf16 keys may take vdpbf16ps; an fp32
// query over a bf16 pool (cache.kv_dtype bf16) keeps its fp32 values and widens the keys.
template <typename T, int NV, bool QB>
static inline void score_slice(const T* rowp, const float* qf, const uint16_t* qb, int64_t G,
                               int64_t quads, int64_t n, int64_t i, __m128 sc4, float* scores) {
  constexpr int64_t D = NV * 16;
#ifdef TL_DECODE_BF16_DOT
  if constexpr (QB && std::is_same_v<T, c10::BFloat16> && NV % 2 == 0) {
    // bf16 keys times the bf16 query on vdpbf16ps: no widening, half the multiply
    // instructions; the products are exact (bf16 x bf16 fits an fp32), two are summed
    // per lane before the fp32 sums, so scores differ from the widening path's only in
    // fp32 rounding. The query is bf16 already (the cache's dtype), nothing is rounded.
    __m512bh kb[NV / 2];
    for (int j = 0; j < NV / 2; ++j)
      kb[j] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(rowp) + 32 * j);
    for (int64_t qd = 0; qd < quads; ++qd) {
      const uint16_t* q4 = qb + qd * 4 * D;
      const int hn = static_cast<int>(std::min<int64_t>(4, G - qd * 4));
      __m512 a[4];
      for (int h = 0; h < 4; ++h) {
        a[h] = _mm512_setzero_ps();
        if (h >= hn) continue;
        for (int j = 0; j < NV / 2; ++j)
          a[h] = _mm512_dpbf16_ps(a[h], kb[j], (__m512bh)_mm512_loadu_si512(q4 + h * D + 32 * j));
      }
      _mm_storeu_ps(scores + (qd * n + i) * 4, _mm_mul_ps(sum4(a[0], a[1], a[2], a[3]), sc4));
    }
    return;
  }
#endif
  __m512 kv[NV];
  for (int j = 0; j < NV; ++j) kv[j] = load16(rowp + 16 * j);
  for (int64_t qd = 0; qd < quads; ++qd) {
    const float* q4 = qf + qd * 4 * D;
    __m512 a[4];
    const int hn = static_cast<int>(std::min<int64_t>(4, G - qd * 4));
    for (int h = 0; h < 4; ++h) {
      if (h >= hn) { a[h] = _mm512_setzero_ps(); continue; }
      a[h] = _mm512_mul_ps(kv[0], _mm512_loadu_ps(q4 + h * D));
      for (int j = 1; j < NV; ++j)
        a[h] = _mm512_fmadd_ps(kv[j], _mm512_loadu_ps(q4 + h * D + 16 * j), a[h]);
    }
    _mm_storeu_ps(scores + (qd * n + i) * 4, _mm_mul_ps(sum4(a[0], a[1], a[2], a[3]), sc4));
  }
}

// Softmax partials, four heads at a time: a quad's scores are 4n floats whose lane i % 4
// is head i % 4, so per-lane max and sums over 16-lane chunks reduce to per-head ones. The
// scores become exp(s - max) in place; pmax / psum get each of the G heads' max and sum.
static inline void softmax_quads(float* scores, int64_t n, int64_t G, int64_t quads,
                                 float* pmax, float* psum) {
  const int64_t len = 4 * n;
  for (int64_t qd = 0; qd < quads; ++qd) {
    float* sc = scores + qd * len;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::max());
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1);
      mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, sc + i));
    }
    mv = _mm512_max_ps(mv, _mm512_shuffle_f32x4(mv, mv, 0x4E));
    mv = _mm512_max_ps(mv, _mm512_shuffle_f32x4(mv, mv, 0xB1));   // per head, every quad of lanes
    __m512 sv = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + i), mv));
      _mm512_mask_storeu_ps(sc + i, k, e);
      sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
    }
    sv = _mm512_add_ps(sv, _mm512_shuffle_f32x4(sv, sv, 0x4E));
    sv = _mm512_add_ps(sv, _mm512_shuffle_f32x4(sv, sv, 0xB1));
    float m4[16], s4[16];
    _mm512_storeu_ps(m4, mv);
    _mm512_storeu_ps(s4, sv);
    for (int64_t h = qd * 4; h < std::min(G, qd * 4 + 4); ++h) {
      pmax[h] = m4[h % 4];
      psum[h] = s4[h % 4];
    }
  }
}

// One work item of the vector path: keys t0..t1 of sequence b against all its query heads
// (KVH kv heads of G query heads each). The key pass walks whole rows, every kv head's
// slice of a key one after another, so the item reads its span of each block front to
// back; the softmax partials and the value pass then go one kv head at a time. qf / qb
// hold the query [kv head][quads * 4 heads, zero-padded][D]; scores [kv head][quad][t][4];
// the partials (max, sum of exp, weighted values) are per query head, as decode_kernel's.
// A quantized cache (T a Code) has a scale per (slot, kv head) on each side, ks / vs
// ([slots, KVH], else null): a key's scale multiplies its scores, a value's its softmax
// weights after their sum is taken, as decode_kernel_q folds them.
template <typename T, int NV, bool QB>
static void decode_item_avx512(const float* qf, const uint16_t* qb, const T* kc, const T* vc,
                               const int64_t* table, int64_t ctx, int64_t t0, int64_t t1,
                               int64_t KVH, int64_t G,
                               int64_t BS, int64_t blk_stride, int64_t row_stride, float scale,
                               float* scores_all, float* acc_all, float* pmax_all,
                               float* psum_all, const float* ks = nullptr,
                               const float* vs = nullptr, float softcap = 0.f) {
  constexpr int64_t D = NV * 16;
  const int64_t n = t1 - t0, quads = (G + 3) / 4, R = KVH * D;
  const __m128 sc4 = _mm_set1_ps(scale);
  for (int64_t t = t0; t < t1;) {
    const int64_t tb = t % BS, te = std::min(t1, t - tb + BS), blk = table[t / BS];
    const int64_t next_blk = t - tb + BS < ctx ? table[t / BS + 1] : -1;
    const T* base = kc + blk * blk_stride;
    const T* next = next_blk >= 0 ? kc + next_blk * blk_stride : nullptr;
    if (ks != nullptr) {   // this block's scales (rows of KVH floats), and the next one's
      prefetch_row(vs + blk * BS * KVH, BS * KVH);
      if (next_blk >= 0) prefetch_row(ks + next_blk * BS * KVH, BS * KVH);
    }
    for (int64_t i = tb; t < te; ++t, ++i) {
      const T* row = base + i * row_stride;
      if (next != nullptr) prefetch_row(next + i * row_stride, R);
      // The value row of the same slot, for the value pass: the span's values arrive in
      // L2 while its keys are computed on (with the L2 hint, cold cache: 1.35x in bf16,
      // 1.4-1.5x in fp32; the hint alone 1.15x / 1.3-1.4x).
      prefetch_row(vc + (row - kc), R);
      const float* kscale = ks != nullptr ? ks + (blk * BS + i) * KVH : nullptr;
      for (int64_t g = 0; g < KVH; ++g)
        score_slice<T, NV, QB>(row + g * D, qf + g * quads * 4 * D, qb + g * quads * 4 * D, G,
                           quads, n, t - t0,
                           kscale != nullptr ? _mm_mul_ps(sc4, _mm_set1_ps(kscale[g])) : sc4,
                           scores_all + g * quads * n * 4);
    }
  }
  // Soft-capped scores (scaled, and a quantized key's scale folded in) before the softmax;
  // the zero-padded heads of a quad stay 0.
  if (softcap > 0.f) softcap_scores(scores_all, KVH * quads * n * 4, softcap);
  for (int64_t g = 0; g < KVH; ++g) {
    const int64_t off = g * D;
    float* scores = scores_all + g * quads * n * 4;
    float* acc = acc_all + g * G * D;
    float* pmax = pmax_all + g * G;
    float* psum = psum_all + g * G;
    softmax_quads(scores, n, G, quads, pmax, psum);
    if (vs != nullptr) {   // each key's weights times its value row's scale
      for (int64_t t = t0; t < t1; ++t) {
        const __m128 v = _mm_set1_ps(vs[(table[t / BS] * BS + t % BS) * KVH + g]);
        for (int64_t qd = 0; qd < quads; ++qd) {
          float* w = scores + (qd * n + t - t0) * 4;
          _mm_storeu_ps(w, _mm_mul_ps(_mm_loadu_ps(w), v));
        }
      }
    }
    // Weighted values, four heads at a time; with D <= 64 their 4 x NV sums stay in registers.
    for (int64_t qd = 0; qd < quads; ++qd) {
      const int64_t hn = std::min<int64_t>(4, G - qd * 4);
      const float* pq = scores + qd * n * 4;
      if constexpr (NV <= 4) {
        switch (hn) {
#define TL_PV(HN)                                                                   \
  case HN:                                                                          \
    pv_quad<T, NV, HN>(pq, vc, table, ctx, t0, t1, off, BS, blk_stride, row_stride, \
                       acc + qd * 4 * D);                                           \
    break;
          TL_PV(1) TL_PV(2) TL_PV(3) TL_PV(4)
#undef TL_PV
        }
      } else {
        float* aq = acc + qd * 4 * D;
        std::fill(aq, aq + hn * D, 0.f);
        TL_FOR_KEYS(vc)
          __m512 vv[NV];
          for (int j = 0; j < NV; ++j) vv[j] = load16(rowp + 16 * j);
          for (int64_t h = 0; h < hn; ++h) {
            const __m512 p = _mm512_set1_ps(pq[(t - t0) * 4 + h]);
            float* ah = aq + h * D;
            for (int j = 0; j < NV; ++j)
              _mm512_storeu_ps(ah + 16 * j, _mm512_fmadd_ps(p, vv[j], _mm512_loadu_ps(ah + 16 * j)));
          }
        TL_END_KEYS
      }
    }
  }
}
#endif

// Keys per work item of the vector path: small enough that a lone sequence's context
// splits into several items that two or more threads take in turn (a 1,100-token decode is
// 18 spans), fixed so that the result does not depend on the thread count or the batch.
constexpr int64_t kVecSpan = 64;

#if !defined(TL_DECODE_AVX512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TL_DECODE_AVX2 1
#endif

// false: every call takes the scalar loops (for tests and side-by-side measurements).
static bool g_vector_path = true;

#if defined(TL_DECODE_AVX512) || defined(TL_DECODE_AVX2)
// The vector path: items are (sequence, span of kVecSpan keys) with all its heads, taken
// from a shared counter (spans differ in length: the last one of a sequence is short),
// merged per (sequence, head) as decode_kernel's spans are. D a multiple of 16 up to 256.
// All kv heads in one item, not one item per kv head: the item then walks its blocks'
// rows front to back (a key row is [kv heads, D], contiguous), which the memory system
// streams; a kv head's slice of each row (128 or 256 bytes of every 384 or 768) read
// 1.1-1.3x slower from a cold cache (session 19, with the L2 prefetch above).
// `item(qf, qb, table, ctx, t0, t1, scores, acc, pmax, psum)` computes one item's
// partials. With a sliding `window` (> 0) a sequence's spans start at its first visible key
// (first_visible).
template <typename T>
class SpanItems {
 public:
  SpanItems(const int64_t* lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
            int64_t window = 0)
      : lens_(lens), B_(B), H_(H), KVH_(KVH), D_(D), G_(H / KVH), window_(window),
        first_(B + 1, 0) {
    for (int64_t b = 0; b < B; ++b)   // items of sequence b: first_[b]..first_[b + 1]
      first_[b + 1] = first_[b] + std::max<int64_t>(
          1, (lens[b] - first_visible(lens[b], window) + kVecSpan - 1) / kVecSpan);
    items_ = first_[B];
    part_acc_.resize(items_ * H * D);
    part_max_.resize(items_ * H);
    part_sum_.resize(items_ * H);
  }

  int64_t items() const { return items_; }
  void reset() { next_.store(0, std::memory_order_relaxed); }

  // One thread's buffers: the query [kv head][quads * 4 heads, zero-padded][D] (fp32, and
  // bf16 for the vdpbf16ps path) and an item's scores.
  struct Scratch {
    std::vector<float> qf, scores;
    std::vector<uint16_t> qb;
    Scratch(int64_t KVH, int64_t G, int64_t D)
        : qf(KVH * ((G + 3) / 4 * 4) * D, 0.f), scores(KVH * ((G + 3) / 4 * 4) * kVecSpan),
          qb(KVH * ((G + 3) / 4 * 4) * D, 0) {}
  };

  // Takes items from the shared counter until none is left (every thread of a call). Not
  // inlined (nor merge): paged_decode's threads and the decode stack's team (team.h) run
  // one compiled body with one item functor type, so that their results are bit-identical
  // (-ffast-math lets two inlined copies order a sum differently).
  template <typename Item>
  __attribute__((noinline)) void run(const T* q, const int64_t* tables, int64_t max_blocks, Scratch& s,
           const Item& item_fn) {
    const int64_t H = H_, D = D_, G = G_, QH = (G + 3) / 4 * 4;
    int64_t item;
    while ((item = next_.fetch_add(1, std::memory_order_relaxed)) < items_) {
      const int64_t b = std::upper_bound(first_.begin(), first_.end(), item) - first_.begin() - 1;
      const int64_t span = item - first_[b];
      const int64_t ctx = lens_[b], t0 = first_visible(ctx, window_) + span * kVecSpan;
      const int64_t t1 = std::min(ctx, t0 + kVecSpan);
      float* pm = &part_max_[item * H];
      float* ps = &part_sum_[item * H];
      float* pa = &part_acc_[item * H * D];
      if (t1 <= t0) {   // an empty sequence
        std::fill(ps, ps + H, 0.f);
        std::fill(pm, pm + H, 0.f);
        std::fill(pa, pa + H * D, 0.f);
        continue;
      }
      for (int64_t g = 0; g < KVH_; ++g) {
        const T* qg = q + (b * H + g * G) * D;
        for (int64_t i = 0; i < G * D; ++i) s.qf[g * QH * D + i] = to_f(qg[i]);
        if constexpr (std::is_same_v<T, c10::BFloat16>)   // the vdpbf16ps path's query
          std::memcpy(s.qb.data() + g * QH * D, qg, G * D * sizeof(uint16_t));
      }
      item_fn(s.qf.data(), s.qb.data(), tables + b * max_blocks, ctx, t0, t1, s.scores.data(),
              pa, pm, ps);
    }
  }

  // Each (sequence, head)'s spans merged into out [B, H, D].
  __attribute__((noinline)) void merge(T* out) const {
    const int64_t H = H_, D = D_;
    at::parallel_for(0, B_, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> o(D);
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t i0 = first_[b], i1 = first_[b + 1];
          float m = -std::numeric_limits<float>::max();
          for (int64_t i = i0; i < i1; ++i)
            if (part_sum_[i * H + h] > 0.f) m = std::max(m, part_max_[i * H + h]);
          float sum = 0.f;
          std::fill(o.begin(), o.end(), 0.f);
          for (int64_t i = i0; i < i1; ++i) {
            if (part_sum_[i * H + h] == 0.f) continue;
            const float w = std::exp(part_max_[i * H + h] - m);
            sum += w * part_sum_[i * H + h];
            const float* a = &part_acc_[(i * H + h) * D];
            for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
          }
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
          for (int64_t d = 0; d < D; ++d) out[(b * H + h) * D + d] = static_cast<T>(o[d] * inv);
        }
      }
    });
  }

 private:
  const int64_t* lens_;
  int64_t B_, H_, KVH_, D_, G_, window_, items_ = 0;
  std::vector<int64_t> first_;
  std::vector<float> part_acc_, part_max_, part_sum_;
  std::atomic<int64_t> next_{0};
};

template <typename T, typename Item>
static void decode_spans_vec(const T* q, const int64_t* tables, const int64_t* lens, T* out,
                                int64_t B, int64_t H, int64_t KVH, int64_t D,
                                int64_t max_blocks, int64_t window, const Item& item_fn) {
  SpanItems<T> spans(lens, B, H, KVH, D, window);
  at::parallel_for(0, std::min<int64_t>(spans.items(), at::get_num_threads()), 1,
                   [&](int64_t, int64_t) {
    typename SpanItems<T>::Scratch s(KVH, H / KVH, D);
    spans.run(q, tables, max_blocks, s, item_fn);
  });
  spans.merge(out);
}

#ifdef TL_DECODE_AVX512
// One item at the head size D (a multiple of 16 up to 256).
template <typename C, bool QB>
static inline void item_avx512(const float* qf, const uint16_t* qb, const C* kc, const C* vc,
                               const int64_t* table, int64_t ctx, int64_t t0, int64_t t1,
                               int64_t KVH, int64_t G, int64_t D, int64_t BS,
                               int64_t blk_stride, int64_t row_stride, float scale,
                               float* scores, float* pa, float* pm, float* ps,
                               const float* ks, const float* vs, float softcap) {
  switch (D / 16) {
#define TL_ITEM(NV)                                                                        \
  case NV:                                                                                 \
    decode_item_avx512<C, NV, QB>(qf, qb, kc, vc, table, ctx, t0, t1, KVH, G, BS, blk_stride, \
                                  row_stride, scale, scores, pa, pm, ps, ks, vs, softcap); \
    break;
    TL_ITEM(1) TL_ITEM(2) TL_ITEM(3) TL_ITEM(4) TL_ITEM(5) TL_ITEM(6) TL_ITEM(7)
    TL_ITEM(8) TL_ITEM(9) TL_ITEM(10) TL_ITEM(11) TL_ITEM(12) TL_ITEM(13) TL_ITEM(14)
    TL_ITEM(15) TL_ITEM(16)
#undef TL_ITEM
  }
}

// One item of a query of T over a cache of C (the functor SpanItems::run calls).
template <typename C, bool QB>
struct ItemAvx512 {
  const C* kc;
  const C* vc;
  int64_t KVH, G, D, BS, blk_stride, row_stride;
  float scale;
  const float* ks;
  const float* vs;
  float softcap = 0.f;   // > 0: scores soft-capped
  void operator()(const float* qf, const uint16_t* qb, const int64_t* table, int64_t ctx,
                  int64_t t0, int64_t t1, float* scores, float* pa, float* pm,
                  float* ps) const {
    item_avx512<C, QB>(qf, qb, kc, vc, table, ctx, t0, t1, KVH, G, D, BS, blk_stride,
                       row_stride, scale, scores, pa, pm, ps, ks, vs, softcap);
  }
};

// C: the cache's element (T; a Code of a quantized cache with its scales ks / vs; or bf16
// or fp16 under an fp32 query, cache.kv_dtype bf16 / fp16). window > 0: each query sees its
// last `window` keys; softcap > 0: scores soft-capped.
template <typename T, typename C = T>
static void decode_kernel_avx512(const T* q, const C* kc, const C* vc, const int64_t* tables,
                                 const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                                 int64_t D, int64_t BS, int64_t max_blocks, int64_t blk_stride,
                                 int64_t row_stride, float scale, int64_t window,
                                 float softcap, const float* ks = nullptr,
                                 const float* vs = nullptr) {
  constexpr bool QB = std::is_same_v<T, c10::BFloat16>;   // the query in bf16 (qb filled)
  decode_spans_vec<T>(q, tables, lens, out, B, H, KVH, D, max_blocks, window,
                      ItemAvx512<C, QB>{kc, vc, KVH, H / KVH, D, BS, blk_stride, row_stride,
                                        scale, ks, vs, softcap});
}
#endif  // TL_DECODE_AVX512

#ifdef TL_DECODE_AVX2
// ---- The vector path on AVX2 (8 lanes): the same items, passes and partials as the
// AVX-512 path above, for fp32, bf16 and fp16 pools (a quantized pool takes
// decode_kernel_q). A head's D is walked in 8-lane vectors, so a key slice is not held in
// registers (D = 64 is 8 of AVX2's 16); keys go to a quad's heads from L1 instead, and the
// value pass runs over the span once per 32 dims of the head (HN x 4 accumulators), the
// span's value rows in L1 / L2 after the first. The scalar loops measured compute-bound on
// a 2-core AVX2 machine: a lone sequence's 800 extra keys cost ~5 ms a step over 30 layers
// against ~0.6 ms of KV bytes.

// 8 cache elements as fp32: bf16 is the top half of an fp32, fp16 converts in hardware.
template <typename T>
static inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]: hadd pairs within each 128-bit half, then the halves.
static inline __m128 sum4_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The scores of one key slice (one kv head, D elements) against HN query heads of a quad
// (q4: the quad's zero-padded query, [4][D]), stored as 4 floats at `dst`.
template <typename T, int HN>
static inline void score_quad_avx2(const T* rowp, const float* q4, int64_t D, __m128 sc4,
                                   float* dst) {
  __m256 a[4];
  for (int h = 0; h < 4; ++h) a[h] = _mm256_setzero_ps();
  for (int64_t j = 0; j < D; j += 8) {
    const __m256 k = load8(rowp + j);
    for (int h = 0; h < HN; ++h) a[h] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q4 + h * D + j), a[h]);
  }
  _mm_storeu_ps(dst, _mm_mul_ps(sum4_avx2(a[0], a[1], a[2], a[3]), sc4));
}

// Softmax partials of a kv head's quads (scores [quad][t][4], lane i % 4 = head i % 4), as
// softmax_quads: the scores become exp(s - max) in place; pmax / psum per query head.
static inline void softmax_quads_avx2(float* scores, int64_t n, int64_t G, int64_t quads,
                                      float* pmax, float* psum) {
  const int64_t len = 4 * n;
  for (int64_t qd = 0; qd < quads; ++qd) {
    float* sc = scores + qd * len;
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::max());
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    if (i < len) m4 = _mm_max_ps(m4, _mm_loadu_ps(sc + i));   // an odd key: 4 scores left
    const __m256 mm = _mm256_set_m128(m4, m4);
    __m256 sv = _mm256_setzero_ps();
    for (i = 0; i + 8 <= len; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mm));
      _mm256_storeu_ps(sc + i, e);
      sv = _mm256_add_ps(sv, e);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sv), _mm256_extractf128_ps(sv, 1));
    if (i < len) {   // the last 4 scores in the lower half; the upper half is exp(0), unused
      const __m256 e = exp8(_mm256_sub_ps(_mm256_insertf128_ps(mm, _mm_loadu_ps(sc + i), 0), mm));
      _mm_storeu_ps(sc + i, _mm256_castps256_ps128(e));
      s4 = _mm_add_ps(s4, _mm256_castps256_ps128(e));
    }
    float mx[4], sm[4];
    _mm_storeu_ps(mx, m4);
    _mm_storeu_ps(sm, s4);
    for (int64_t h = qd * 4; h < std::min(G, qd * 4 + 4); ++h) {
      pmax[h] = mx[h % 4];
      psum[h] = sm[h % 4];
    }
  }
}

// P . V over dims c0 .. c0 + 8 * CH of HN heads of a quad (pq: the quad's weights [t][4]):
// HN x CH sums in registers, the span's value rows walked block by block. A key's HN
// weights are broadcast once and its value vectors converted one at a time, so the loop
// holds HN x CH + HN + 1 vectors: callers keep that within 14 of AVX2's 16 (4 x 4 sums + 4
// values + 1 weight spilled a sum to the stack: a store-to-load chain through every key,
// 26% of a 4,000-key decode's samples in `perf annotate`; and 3 x 4 sums, exactly 16, spilled
// all of them once the function was not inlined).
template <typename T, int CH, int HN>
static inline void pv_chunk_avx2(const float* pq, const T* vc, const int64_t* table,
                                 int64_t t0, int64_t t1, int64_t off, int64_t BS,
                                 int64_t blk_stride, int64_t row_stride, int64_t D, float* acc) {
  static_assert(HN * CH + HN + 1 <= 14, "pv_chunk_avx2: sums, weights and a value in 14 ymm");
  __m256 a[HN][CH];
  for (int h = 0; h < HN; ++h)
    for (int j = 0; j < CH; ++j) a[h][j] = _mm256_setzero_ps();
  for (int64_t t = t0; t < t1;) {
    const int64_t tb = t % BS, te = std::min(t1, t - tb + BS);
    const T* base = vc + table[t / BS] * blk_stride + off;
    for (int64_t i = tb; t < te; ++t, ++i) {
      const T* rowp = base + i * row_stride;
      __m256 p[HN];
      for (int h = 0; h < HN; ++h) p[h] = _mm256_broadcast_ss(pq + (t - t0) * 4 + h);
      for (int j = 0; j < CH; ++j) {
        const __m256 v = load8(rowp + 8 * j);
        for (int h = 0; h < HN; ++h) a[h][j] = _mm256_fmadd_ps(p[h], v, a[h][j]);
      }
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int j = 0; j < CH; ++j) _mm256_storeu_ps(acc + h * D + 8 * j, a[h][j]);
}

// One work item: keys t0..t1 of one sequence against all its query heads (decode_item_avx512's
// layout of qf, scores, partials).
template <typename T>
static void decode_item_avx2(const float* qf, const T* kc, const T* vc, const int64_t* table,
                             int64_t ctx, int64_t t0, int64_t t1, int64_t KVH, int64_t G,
                             int64_t D, int64_t BS, int64_t blk_stride, int64_t row_stride,
                             float scale, float* scores_all, float* acc_all, float* pmax_all,
                             float* psum_all, float softcap) {
  const int64_t n = t1 - t0, quads = (G + 3) / 4, R = KVH * D;
  const __m128 sc4 = _mm_set1_ps(scale);
  for (int64_t t = t0; t < t1;) {
    const int64_t tb = t % BS, te = std::min(t1, t - tb + BS);
    const T* base = kc + table[t / BS] * blk_stride;
    const T* next = t - tb + BS < ctx ? kc + table[t / BS + 1] * blk_stride : nullptr;
    for (int64_t i = tb; t < te; ++t, ++i) {
      const T* row = base + i * row_stride;
      if (next != nullptr) prefetch_row(next + i * row_stride, R);
      prefetch_row(vc + (row - kc), R);   // the value pass's row, into L2 meanwhile
      for (int64_t g = 0; g < KVH; ++g) {
        const float* qg = qf + g * quads * 4 * D;
        float* sg = scores_all + g * quads * n * 4;
        for (int64_t qd = 0; qd < quads; ++qd) {
          float* dst = sg + (qd * n + t - t0) * 4;
          const float* q4 = qg + qd * 4 * D;
          switch (std::min<int64_t>(4, G - qd * 4)) {
            case 1: score_quad_avx2<T, 1>(row + g * D, q4, D, sc4, dst); break;
            case 2: score_quad_avx2<T, 2>(row + g * D, q4, D, sc4, dst); break;
            case 3: score_quad_avx2<T, 3>(row + g * D, q4, D, sc4, dst); break;
            default: score_quad_avx2<T, 4>(row + g * D, q4, D, sc4, dst); break;
          }
        }
      }
    }
  }
  if (softcap > 0.f) softcap_scores(scores_all, KVH * quads * n * 4, softcap);
  for (int64_t g = 0; g < KVH; ++g) {
    float* scores = scores_all + g * quads * n * 4;
    float* acc = acc_all + g * G * D;
    softmax_quads_avx2(scores, n, G, quads, pmax_all + g * G, psum_all + g * G);
    for (int64_t qd = 0; qd < quads; ++qd) {
      const int64_t hn = std::min<int64_t>(4, G - qd * 4);
      const float* pq = scores + qd * n * 4;
      // 8-lane vectors of the head per pass (pv_chunk_avx2's register budget): 4 for up to
      // 2 heads, 3 for 3 heads, 2 for 4 heads
      const int64_t width = hn <= 2 ? 4 : 6 - hn;
      for (int64_t c0 = 0; c0 < D; c0 += 8 * width) {
        const int64_t ch = std::min<int64_t>(width, (D - c0) / 8);
        float* aq = acc + qd * 4 * D + c0;
        const int64_t off = g * D + c0;
        switch (ch * 4 + hn) {
#define TL_PV2(CH, HN)                                                                  \
  case CH * 4 + HN:                                                                     \
    pv_chunk_avx2<T, CH, HN>(pq, vc, table, t0, t1, off, BS, blk_stride, row_stride, D, \
                             aq);                                                       \
    break;
          TL_PV2(1, 1) TL_PV2(1, 2) TL_PV2(1, 3) TL_PV2(1, 4)
          TL_PV2(2, 1) TL_PV2(2, 2) TL_PV2(2, 3) TL_PV2(2, 4)
          TL_PV2(3, 1) TL_PV2(3, 2) TL_PV2(3, 3)
          TL_PV2(4, 1) TL_PV2(4, 2)
#undef TL_PV2
        }
      }
    }
  }
}

// One item over a cache of C (the functor SpanItems::run calls).
template <typename C>
struct ItemAvx2 {
  const C* kc;
  const C* vc;
  int64_t KVH, G, D, BS, blk_stride, row_stride;
  float scale;
  float softcap = 0.f;   // > 0: scores soft-capped
  void operator()(const float* qf, const uint16_t*, const int64_t* table, int64_t ctx,
                  int64_t t0, int64_t t1, float* scores, float* pa, float* pm,
                  float* ps) const {
    decode_item_avx2<C>(qf, kc, vc, table, ctx, t0, t1, KVH, G, D, BS, blk_stride, row_stride,
                        scale, scores, pa, pm, ps, softcap);
  }
};

template <typename T, typename C = T>
static void decode_kernel_avx2(const T* q, const C* kc, const C* vc, const int64_t* tables,
                               const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                               int64_t D, int64_t BS, int64_t max_blocks, int64_t blk_stride,
                               int64_t row_stride, float scale, int64_t window, float softcap) {
  decode_spans_vec<T>(q, tables, lens, out, B, H, KVH, D, max_blocks, window,
                      ItemAvx2<C>{kc, vc, KVH, H / KVH, D, BS, blk_stride, row_stride, scale,
                                  softcap});
}
#endif  // TL_DECODE_AVX2

// The vector path for the decode stack's team (team.h): a query of T (fp32 or bf16) over a
// pool of C, the same items and merge as paged_decode's call, the items shared by the
// team's threads.
template <typename T, typename C>
class TeamDecodeAttention final : public tl_team::DecodeAttention {
 public:
  explicit TeamDecodeAttention(const tl_team::AttentionShape& a)
      : a_(a), spans_(a.lens, a.b, a.h, a.kvh, a.d) {
    for (int p = 0; p < a.parts; ++p) scratch_.emplace_back(a.kvh, a.h / a.kvh, a.d);
  }
  void bind(const void* q, const void* kc, const void* vc, void* out) override {
    q_ = static_cast<const T*>(q);
    kc_ = static_cast<const C*>(kc);
    vc_ = static_cast<const C*>(vc);
    out_ = static_cast<T*>(out);
    spans_.reset();
  }
  void items(int part) override {
    const auto& a = a_;
    const int64_t G = a.h / a.kvh;
#ifdef TL_DECODE_AVX512
    const ItemAvx512<C, std::is_same_v<T, c10::BFloat16>> item{
        kc_, vc_, a.kvh, G, a.d, a.block_size, a.blk_stride, a.row_stride, a.scale,
        nullptr, nullptr};
#else
    const ItemAvx2<C> item{kc_, vc_, a.kvh, G, a.d, a.block_size, a.blk_stride, a.row_stride,
                           a.scale};
#endif
    spans_.run(q_, a.tables, a.max_blocks, scratch_[part], item);
  }
  void merge() override { spans_.merge(out_); }

 private:
  tl_team::AttentionShape a_;
  SpanItems<T> spans_;
  std::vector<typename SpanItems<T>::Scratch> scratch_;
  const T* q_ = nullptr;
  const C* kc_ = nullptr;
  const C* vc_ = nullptr;
  T* out_ = nullptr;
};
#endif

// Null where paged_decode would not take the vector path for this shape.
static tl_team::DecodeAttention* make_team_decode_attention(const tl_team::AttentionShape& a) {
#if defined(TL_DECODE_AVX512) || defined(TL_DECODE_AVX2)
#ifdef TL_DECODE_AVX512
  const bool shaped = a.d % 16 == 0 && a.d <= 256;
#else
  const bool shaped = a.d % 8 == 0 && a.d <= 256;
#endif
  if (!g_vector_path || !shaped || a.parts < 1 || a.kvh < 1 || a.h % a.kvh != 0) return nullptr;
  if (a.query == 1)   // bf16 activations: a bf16 pool (paged_decode's only bf16 pairing)
    return a.pool == 1 ? new TeamDecodeAttention<c10::BFloat16, c10::BFloat16>(a) : nullptr;
  switch (a.pool) {
    case 0: return new TeamDecodeAttention<float, float>(a);
    case 1: return new TeamDecodeAttention<float, c10::BFloat16>(a);
    case 2: return new TeamDecodeAttention<float, c10::Half>(a);
  }
#endif
  (void)a;
  return nullptr;
}

template <typename T, typename C = T>
static void decode_kernel(const T* q, const C* kc, const C* vc, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t BS, int64_t max_blocks, int64_t blk_stride,
                          int64_t row_stride, float scale, int64_t window = 0,
                          float softcap = 0.f) {
  const int64_t G = H / KVH;
  std::vector<int64_t> first(B + 1, 0);   // sequence b's spans are items first[b]..first[b+1]
  for (int64_t b = 0; b < B; ++b)   // (from its first visible key: SpanItems)
    first[b + 1] = first[b] + std::max<int64_t>(
        1, (lens[b] - first_visible(lens[b], window) + kSpan - 1) / kSpan);
  const int64_t items = first[B];
  std::vector<float> part_acc(items * H * D), part_max(items * H), part_sum(items * H);
  // One work item per span: a token's keys for all kv heads are one contiguous row
  // ([KVH, D]) of its block, so walking t in order streams each block front to back.
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), scores, row(row_stride);
    int64_t b = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (first[b + 1] <= item) ++b;
      const int64_t ctx = lens[b];
      const int64_t t0 = first_visible(ctx, window) + (item - first[b]) * kSpan;
      const int64_t t1 = std::min(ctx, t0 + kSpan);
      const int64_t n = std::max<int64_t>(t1 - t0, 0);
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_f(q[b * H * D + i]) * scale;
      scores.assign(H * n, 0.f);
      // Pass 1: scores[h, t] = q_h . k_t(kv head of h)
      for (int64_t t = t0; t < t1; ++t) {
        const C* k = kc + table[t / BS] * blk_stride + (t % BS) * row_stride;
        if (t + BS < ctx) prefetch_row(kc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        const float* kf;
        if constexpr (std::is_same_v<C, float>) {
          kf = k;
        } else {
          for (int64_t i = 0; i < row_stride; ++i) row[i] = to_f(k[i]);
          kf = row.data();
        }
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = &qf[h * D];
          const float* kh = kf + (h / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[h * n + t - t0] = s;
        }
      }
      if (softcap > 0.f) softcap_scores(scores.data(), H * n, softcap);
      // Softmax partials per query head (fp32): the span's max and sum of exp(s - max).
      for (int64_t h = 0; h < H; ++h) {
        float* sc = &scores[h * n];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = sc[t] > m ? sc[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { sc[t] = std::exp(sc[t] - m); sum += sc[t]; }
        part_max[item * H + h] = m;
        part_sum[item * H + h] = sum;
      }
      // Pass 2: acc[h] = sum_t exp(s[h, t] - max) * v_t(kv head of h)
      float* acc = &part_acc[item * H * D];
      std::fill(acc, acc + H * D, 0.f);
      for (int64_t t = t0; t < t1; ++t) {
        const C* v = vc + table[t / BS] * blk_stride + (t % BS) * row_stride;
        if (t + BS < ctx) prefetch_row(vc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        const float* vf;
        if constexpr (std::is_same_v<C, float>) {
          vf = v;
        } else {
          for (int64_t i = 0; i < row_stride; ++i) row[i] = to_f(v[i]);
          vf = row.data();
        }
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * n + t - t0];
          const float* vh = vf + (h / G) * D;
          float* a = &acc[h * D];
          for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
        }
      }
    }
  });
  // Merge each sequence's spans: weights exp(max_span - max_all), one division at the end.
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = first[b]; i < first[b + 1]; ++i) m = std::max(m, part_max[i * H + h]);
        float sum = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t i = first[b]; i < first[b + 1]; ++i) {
          if (part_sum[i * H + h] == 0.f) continue;   // an empty span (no keys)
          const float w = std::exp(part_max[i * H + h] - m);
          sum += w * part_sum[i * H + h];
          const float* a = &part_acc[(i * H + h) * D];
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t d = 0; d < D; ++d) out[(b * H + h) * D + d] = static_cast<T>(o[d] * inv);
      }
    }
  });
}

// window > 0: each sequence's query sees its last `window` keys only; softcap > 0: scores
// become softcap * tanh(score / softcap) before the softmax (0: neither, as before).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode: window and softcap >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_tables and context_lens must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2);
  TORCH_CHECK(D <= 256, "head_dim must be <= 256");
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of kv_heads");
  auto out = torch::empty_like(q);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t blk_stride = BS * KVH * D, row_stride = KVH * D;
  // The query's dtype and the pool's: the same, or an fp32 query over a bf16 or fp16 pool
  // (cache.kv_dtype bf16 / fp16 under an fp32 model: rows widened as they are loaded).
  auto run = [&](auto q_tag, auto c_tag) {
    using T = decltype(q_tag);
    using C = decltype(c_tag);
    const T* qp = q.data_ptr<T>();
    const C* kp = reinterpret_cast<const C*>(key_cache.data_ptr());
    const C* vp = reinterpret_cast<const C*>(value_cache.data_ptr());
    T* op = out.data_ptr<T>();
#ifdef TL_DECODE_AVX512
    if (g_vector_path && D % 16 == 0 && D <= 256) {
      decode_kernel_avx512<T, C>(qp, kp, vp, block_tables.data_ptr<int64_t>(),
                                 context_lens.data_ptr<int64_t>(), op, B, H, KVH, D, BS,
                                 max_blocks, blk_stride, row_stride, static_cast<float>(scale),
                                 window, cap);
      return;
    }
#elif defined(TL_DECODE_AVX2)
    if (g_vector_path && D % 8 == 0 && D <= 256) {
      decode_kernel_avx2<T, C>(qp, kp, vp, block_tables.data_ptr<int64_t>(),
                               context_lens.data_ptr<int64_t>(), op, B, H, KVH, D, BS,
                               max_blocks, blk_stride, row_stride, static_cast<float>(scale),
                               window, cap);
      return;
    }
#endif
    decode_kernel<T, C>(qp, kp, vp, block_tables.data_ptr<int64_t>(),
                        context_lens.data_ptr<int64_t>(), op, B, H, KVH, D, BS, max_blocks,
                        blk_stride, row_stride, static_cast<float>(scale), window, cap);
  };
  const auto qt = q.scalar_type(), ct = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == ct, "key and value caches must share a dtype");
  if (qt == at::kFloat && ct == at::kFloat) run(float{}, float{});
  else if (qt == at::kBFloat16 && ct == at::kBFloat16) run(c10::BFloat16{}, c10::BFloat16{});
  else if (qt == at::kHalf && ct == at::kHalf) run(c10::Half{}, c10::Half{});
  else if (qt == at::kFloat && ct == at::kBFloat16) run(float{}, c10::BFloat16{});
  else if (qt == at::kFloat && ct == at::kHalf) run(float{}, c10::Half{});
  else if (qt == at::kDouble && ct == at::kDouble) {   // the scalar loops only
    decode_kernel<double>(q.data_ptr<double>(), key_cache.data_ptr<double>(),
                          value_cache.data_ptr<double>(), block_tables.data_ptr<int64_t>(),
                          context_lens.data_ptr<int64_t>(), out.data_ptr<double>(), B, H, KVH,
                          D, BS, max_blocks, blk_stride, row_stride, static_cast<float>(scale),
                          window, cap);
  } else {
    TORCH_CHECK(false, "paged_decode: a ", qt, " query over a ", ct, " cache (the same dtype, "
                "or an fp32 query over a bf16 or fp16 cache)");
  }
  return out;
}


// ---- Quantized KV (kernels/kv_quant.py): 1-byte values, one fp32 scale per (token, kv head).
// Values are decoded to fp32 a row at a time (branch-free, so the loops vectorize) and the
// scales are folded in where they cost least: a key's scale multiplies its dot products
// (one multiply per head, not per element), a value's scale multiplies the softmax weight.

// fmt: 0 int8, 1 fp8 e4m3 (bias 7), 2 fp8 e5m2 (bias 15). NaN/inf codes never occur: the
// store clamps to the format's largest finite value.
static inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

static inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// fp8 -> fp32 with integer selects only (no branches, so the loop vectorizes): a normal
// code's exponent is rebiased into fp32's; a subnormal one is its mantissa times the
// smallest step; the sign bit moves to bit 31.
template <int MANT, int BIAS>
static inline void decode_fp8(const uint8_t* __restrict src, float* __restrict dst, int64_t n) {
  constexpr uint32_t rebias = static_cast<uint32_t>(127 - BIAS) << 23;
  constexpr float step = 1.0f / static_cast<float>(1 << (BIAS - 1 + MANT));
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = src[i], em = b & 0x7f, sign = (b & 0x80) << 24;
    const uint32_t normal = ((em << (23 - MANT)) + rebias) | sign;
    const uint32_t sub = float_to_bits(static_cast<float>(em) * step) | sign;
    dst[i] = bits_to_float(em >= (1u << MANT) ? normal : sub);
  }
}

static inline void decode_row(const uint8_t* __restrict src, float* __restrict dst, int64_t n,
                              int fmt) {
  if (fmt == 0) {
    const int8_t* s = reinterpret_cast<const int8_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  } else if (fmt == 1) {
    decode_fp8<3, 7>(src, dst, n);
  } else {
    decode_fp8<2, 15>(src, dst, n);
  }
}

template <typename T>
static void decode_kernel_q(const T* q, const uint8_t* kc, const uint8_t* vc, const float* ks,
                            const float* vs, int kfmt, int vfmt, const int64_t* tables,
                            const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                            int64_t D, int64_t BS, int64_t max_blocks, float scale,
                            int64_t window, float softcap) {
  const int64_t G = H / KVH, row_stride = KVH * D, blk_stride = BS * row_stride;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores, row(row_stride), pv(KVH);
    for (int64_t b = begin; b < end; ++b) {
      // keys lo .. ctx - 1, score t at scores[h * n + t - lo]
      const int64_t ctx = lens[b], lo = first_visible(ctx, window), n = ctx - lo;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_f(q[b * H * D + i]) * scale;
      scores.assign(H * n, 0.f);
      for (int64_t t = lo; t < ctx; ++t) {
        const int64_t blk = table[t / BS];
        if (t + BS < ctx) prefetch_row(kc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        decode_row(kc + blk * blk_stride + (t % BS) * row_stride, row.data(), row_stride, kfmt);
        const float* sc = ks + (blk * BS + t % BS) * KVH;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = &qf[h * D];
          const float* kh = row.data() + (h / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[h * n + t - lo] = s * sc[h / G];
        }
      }
      if (softcap > 0.f) softcap_scores(scores.data(), H * n, softcap);
      for (int64_t h = 0; h < H; ++h) {
        float* s = &scores[h * n];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = lo; t < ctx; ++t) {
        const int64_t blk = table[t / BS];
        if (t + BS < ctx) prefetch_row(vc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        decode_row(vc + blk * blk_stride + (t % BS) * row_stride, row.data(), row_stride, vfmt);
        const float* sc = vs + (blk * BS + t % BS) * KVH;
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * n + t - lo] * sc[h / G];
          const float* vh = row.data() + (h / G) * D;
          float* a = &acc[h * D];
          for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
        }
      }
      for (int64_t i = 0; i < H * D; ++i) out[b * H * D + i] = static_cast<T>(acc[i]);
    }
  });
}

torch::Tensor paged_decode_q(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                             torch::Tensor key_scale, torch::Tensor value_scale, int64_t kfmt,
                             int64_t vfmt, torch::Tensor block_tables, torch::Tensor context_lens,
                             double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode_q: window and softcap >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.scalar_type() == torch::kUInt8 &&
              value_cache.scalar_type() == torch::kUInt8,
              "quantized caches must be uint8 [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_scale.is_contiguous() && value_scale.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_scale.scalar_type() == torch::kFloat32 && value_scale.scalar_type() == torch::kFloat32,
              "scales must be float32 [num_blocks, block_size, kv_heads]");
  TORCH_CHECK(kfmt >= 0 && kfmt <= 2 && vfmt >= 0 && vfmt <= 2, "format must be 0, 1 or 2");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_tables and context_lens must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2);
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of kv_heads");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_q", [&] {
#ifdef TL_DECODE_AVX512
    // The vector path when both sides share a format (the codes are a template type);
    // mixed formats (cache.k_dtype != cache.v_dtype) take the scalar loops.
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (g_vector_path && D % 16 == 0 && D <= 256 && kfmt == vfmt) {
        auto run = [&](auto tag) {
          using C = decltype(tag);
          const int64_t row_stride = KVH * D;
          decode_kernel_avx512<scalar_t, C>(
              q.data_ptr<scalar_t>(), reinterpret_cast<const C*>(key_cache.data_ptr<uint8_t>()),
              reinterpret_cast<const C*>(value_cache.data_ptr<uint8_t>()),
              block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
              out.data_ptr<scalar_t>(), B, H, KVH, D, BS, block_tables.size(1),
              BS * row_stride, row_stride, static_cast<float>(scale), window, cap,
              key_scale.data_ptr<float>(), value_scale.data_ptr<float>());
        };
        if (kfmt == 0) run(Code<0>{});
        else if (kfmt == 1) run(Code<1>{});
        else run(Code<2>{});
        return;
      }
    }
#endif
    decode_kernel_q<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<uint8_t>(),
                              value_cache.data_ptr<uint8_t>(), key_scale.data_ptr<float>(),
                              value_scale.data_ptr<float>(), static_cast<int>(kfmt),
                              static_cast<int>(vfmt), block_tables.data_ptr<int64_t>(),
                              context_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H,
                              KVH, D, BS, block_tables.size(1), static_cast<float>(scale),
                              window, cap);
  });
  return out;
}

// How many threads at::parallel_for spreads `n` one-item tasks over: 1 if the module was
// built without OpenMP, whatever torch's thread setting (tested).
int64_t parallel_threads(int64_t n) {
  std::vector<int> used(at::get_num_threads(), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  int64_t count = 0;
  for (int u : used) count += u;
  return count;
}

// Write key/value [T, KVH, D] into their cache slots; slot < 0 (a padded row of a static
// decode program) is skipped in place, without filtering on the host. fp32 rows into a
// bf16 or fp16 pool (cache.kv_dtype bf16 / fp16) are rounded as they are copied
// (tl_rows::to_pool).
template <typename S, typename C>
static void store_rows(const torch::Tensor& key, const torch::Tensor& value, C* kc, C* vc,
                       const int64_t* slot, int64_t T, int64_t row, int64_t capacity) {
  const S* k = key.data_ptr<S>();
  const S* v = value.data_ptr<S>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    TORCH_CHECK(slot[t] < capacity, "slot ", slot[t], " is outside the cache");
    C* kd = kc + slot[t] * row;
    C* vd = vc + slot[t] * row;
    for (int64_t i = 0; i < row; ++i) kd[i] = tl_rows::to_pool<C>(k[t * ks + i]);
    for (int64_t i = 0; i < row; ++i) vd[i] = tl_rows::to_pool<C>(v[t * vs + i]);
  }
}

void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slots) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64, "slots must be int64");
  const auto st = key.scalar_type(), ct = key_cache.scalar_type();
  TORCH_CHECK(value.scalar_type() == st && value_cache.scalar_type() == ct,
              "key and value (and their caches) must share a dtype");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "each token's K/V rows must be contiguous");
  slots = slots.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = key_cache.numel() / row;
  if (st == ct) {   // bytes: any dtype
    const int64_t elem = key.element_size();
    char* kc = static_cast<char*>(key_cache.data_ptr());
    char* vc = static_cast<char*>(value_cache.data_ptr());
    const char* k = static_cast<const char*>(key.data_ptr());
    const char* v = static_cast<const char*>(value.data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      if (slot[t] < 0) continue;
      TORCH_CHECK(slot[t] < capacity, "slot ", slot[t], " is outside the cache");
      std::memcpy(kc + slot[t] * row * elem, k + t * key.stride(0) * elem, row * elem);
      std::memcpy(vc + slot[t] * row * elem, v + t * value.stride(0) * elem, row * elem);
    }
  } else if (st == at::kFloat && ct == at::kBFloat16) {
    store_rows<float>(key, value, key_cache.data_ptr<c10::BFloat16>(),
                      value_cache.data_ptr<c10::BFloat16>(), slot, T, row, capacity);
  } else if (st == at::kFloat && ct == at::kHalf) {
    store_rows<float>(key, value, key_cache.data_ptr<c10::Half>(),
                      value_cache.data_ptr<c10::Half>(), slot, T, row, capacity);
  } else {
    TORCH_CHECK(false, "store_kv: ", st, " rows into a ", ct, " cache (the same dtype, or fp32 "
                "rows into a bf16 or fp16 cache)");
  }
}

// The same kernels as dispatcher operators, so that a compiled (torch.compile) decode
// program can call them (graphs/cpu_compile.py registers their shape functions). The plain
// ops keep their schemas (the decode stack calls them typed); a layer with a sliding window
// or soft-capped scores calls paged_decode_window_cpu.
static torch::Tensor paged_decode_plain(torch::Tensor q, torch::Tensor key_cache,
                                        torch::Tensor value_cache, torch::Tensor block_tables,
                                        torch::Tensor context_lens, double scale) {
  return paged_decode(q, key_cache, value_cache, block_tables, context_lens, scale, 0, 0.0);
}

static torch::Tensor prefill_paged_plain(torch::Tensor q, torch::Tensor key_cache,
                                         torch::Tensor value_cache, torch::Tensor block_table,
                                         int64_t start_pos, double scale) {
  return prefill_attention_paged(q, key_cache, value_cache, block_table, start_pos, scale, 0,
                                 0.0);
}

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("paged_decode_cpu(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_window_cpu(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int window, float softcap) "
        "-> Tensor");
  m.def("store_kv_cpu(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
  m.def("prefill_attention_paged_cpu(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, int start_pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("paged_decode_cpu", &paged_decode_plain);
  m.impl("paged_decode_window_cpu", &paged_decode);
  m.impl("store_kv_cpu", &store_kv);
  m.impl("prefill_attention_paged_cpu", &prefill_paged_plain);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  // window 0 / softcap 0: a plain causal layer (each positive: the layer's option).
  m.def("paged_decode", &paged_decode, "paged-attention decode over the block pool (CPU)",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("paged_decode_q", &paged_decode_q, "paged-attention decode over a quantized pool (CPU)",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("key_scale"),
        py::arg("value_scale"), py::arg("kfmt"), py::arg("vfmt"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("store_kv", &store_kv, "write K/V rows into their cache slots, skipping slot < 0");
  m.def("prefill_attention", &prefill_attention, "causal prefill attention (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("prefill_attention_paged", &prefill_attention_paged,
        "causal prefill attention reading K/V through a block table (CPU)", py::arg("q"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("start_pos"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("prefill_bf16_dot_built", &prefill_bf16_dot_built,
        "whether bf16 prefill attention runs the AVX512-BF16 kernel");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses for n items");
  m.def("decode_vector_path", []() {
#if defined(TL_DECODE_AVX512)
    return std::string("avx512");
#elif defined(TL_DECODE_AVX2)
    return std::string("avx2");
#else
    return std::string("scalar");
#endif
  }, "which vector path decode attention has (avx512, avx2, or scalar loops only)");
  m.def("team_factory", []() {
    return pybind11::capsule(reinterpret_cast<void*>(&make_team_decode_attention),
                             tl_team::kAttentionCapsule);
  }, "decode attention for the decode stack's one OpenMP team per step (team.h)");
  m.def("use_vector_path", [](bool on) { g_vector_path = on; },
        "false: decode attention takes the scalar loops (for tests and measurements)");
}
