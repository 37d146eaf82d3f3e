// Causal prefill attention for the CPU (included by paged_decode_cpu.cpp): two kernels
// behind two entry points, prefill_attention() (K and V as [KVH, ctx, D] views) and
// prefill_attention_paged() (K and V read through a block table, straight from the pool).
//
// - prefill_fp32: fp32 arithmetic throughout, for fp32 models and for bf16 models on a CPU
//   without AVX512-BF16 (or an odd head size);
// - prefill_bf16_dot: bf16 models on a CPU with AVX512-BF16. Both products are vdpbf16ps
//   (two bf16 products summed into each fp32 lane per instruction: twice the fp32 FMA's work
//   per instruction), with the softmax in fp32 and its numerators rounded to bf16 before
//   P . V, as torch's own flash-attention kernel does for bf16 (so the rounding is the one
//   SDPA has in bf16 too). K and V are repacked once per call into the pair layout the
//   instruction reads.
//
// A continuation chunk (a prompt's later chunk, or the suffix after a cached prefix) reads
// its context through the paged entry: the rows are repacked from their blocks directly,
// instead of being gathered into a contiguous copy first and repacked from that. Both
// kernels keep their repacked K/V and score rows in per-thread buffers that outlive the
// call: allocating and zeroing them per call (1.5 MB a layer at 2,000 keys) was ~12% of a
// 64-token chunk's attention after 1,936 cached keys, and the other thread spun idle
// meanwhile. The buffers only grow (to the largest context seen).
//
// A layer's options (kernels/attention.py) are arguments of both entries: a sliding window
// (> 0) bounds the keys repacked and each row's softmax (ChunkWindow: nothing behind the
// first query's window is read), a soft-cap (> 0) caps the scores before the softmax;
// 0 and 0 are the plain causal kernel, its loops unchanged.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "vec_exp.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define TL_PREFILL_BF16_DOT 1
#else
#define TL_PREFILL_BF16_DOT 0
#endif

// Where a key or value row lives (contiguous in d): in a [KVH, ctx, D] view,
// base + h * s_head + t * s_tok; in the pool [blocks, BS, KVH, D],
// base + table[t / BS] * s_blk + (t % BS) * s_tok + h * s_head.
template <typename T>
struct KVRows {
  const T* base;
  int64_t s_head, s_tok;
  const int64_t* table = nullptr;
  int64_t bs = 1, s_blk = 0;
  const T* row(int64_t h, int64_t t) const {
    if (table == nullptr) return base + h * s_head + t * s_tok;
    return base + table[t / bs] * s_blk + (t % bs) * s_tok + h * s_head;
  }
};

template <typename T>
inline KVRows<T> view_rows(const torch::Tensor& x) {      // x: [KVH, ctx, D], stride(2) == 1
  return {reinterpret_cast<const T*>(x.data_ptr()), x.stride(0), x.stride(1)};
}

template <typename T>
inline KVRows<T> pool_rows(const torch::Tensor& cache, const torch::Tensor& table) {
  return {reinterpret_cast<const T*>(cache.data_ptr()), cache.stride(2), cache.stride(1),
          table.data_ptr<int64_t>(), cache.size(1), cache.stride(0)};
}

// A thread's scratch that survives calls (see the top of the file). `Slot` keeps a
// kernel's buffers apart; the contents are whatever the last call left.
template <typename T, int Slot>
inline T* scratch(int64_t count) {
  static thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < count) buf.resize(count);
  return buf.data();
}

template <typename T>
inline float elem_f32(T x) { return static_cast<float>(x); }

// A chunk of n queries at positions ctx - n .. ctx - 1 under a sliding window (> 0): the
// query at position p sees keys p - window + 1 .. p. The kernels repack only keys k0 ..
// ctx - 1, k0 the first query's first visible key (`first`) rounded down to a whole tile
// of `align` keys; the keys k0 .. first - 1 are zeros, never read (nor any before): a
// hybrid KV layout points the blocks behind a window at a reserved block of garbage
// (actors/kv/groups.py). A tile of queries scores from its first row's first visible key
// (rounded down to a tile of keys) and each row's softmax starts at its own. No window:
// k0 = first = 0 and every row starts at key 0, as before.
struct ChunkWindow {
  int64_t window, first, k0;
  ChunkWindow(int64_t n, int64_t ctx, int64_t window, int64_t align)
      : window(window), first(window > 0 ? std::max<int64_t>(0, ctx - n - window + 1) : 0),
        k0(first / align * align) {}
  // The first key the query at position p sees, counted from k0.
  int64_t lo(int64_t p) const {
    return window > 0 ? std::max<int64_t>(0, p - window + 1) - k0 : 0;
  }
};

// Causal prefill attention over a context of `ctx` keys (fp32 or bf16; sums in fp32).
// q: [n, H, D] contiguous; query i sits at position ctx - n + i and sees keys
// 0 .. ctx - n + i (with a `window` > 0, only its last `window` of them: ChunkWindow).
// `softcap` > 0: scores become softcap * tanh(score / softcap) before the softmax.
// Returns [n, H, D] in q's dtype.
//
// torch's fused CPU SDPA ran a 1,024-token causal prefill of the default model (9 heads,
// D = 64) at about 85 GFLOP/s on 2 cores, 40% of the prefill's time. Here K is transposed
// once per call to [KVH][D][ctx] (fp32), so that a tile of kPR query rows x 16 keys is
// kPR x 16 accumulators updated by one 16-key load per d: the scores are a register-tiled
// GEMM, as is P . V (one 16-wide load of a value row per key, kPR FMAs with it). Each
// (head, row tile) is one work item; its scores (kPR x the tile's last key) are a
// per-thread scratch row, and the softmax is the plain two-pass one over them: no mask
// tensor, no materialised [n, ctx] score matrix.
constexpr int64_t kPL = 16;   // keys (score tile) / value lanes per vector
// Register tiles, sized to the vector registers: AVX-512's 32 hold 8 rows x 32 keys of
// scores (16 zmm) and 4 rows x 64 value lanes (16 zmm). AVX2 has 16 registers of half the
// width, where those tiles need 32 and spilled (the kernel ran ~57 GFLOP/s on a 2-core Zen
// 3, about a quarter of its FMA peak). There a tile is 6 query rows: a score pass 6 rows x
// 16 keys (12 ymm), a value pass 6 rows x 16 lanes (12 ymm): 12 independent FMA chains,
// enough to cover the FMA latency (4 x 16 keys, 8 chains, measured 1.1x slower; the
// 1,024-token prefill's attention, 30 layers, 630-685 ms before, 479-532 ms after, in
// alternating processes). The value pass was 3 rows x 32 lanes until session 23: its 4
// value vectors a key could not stay in registers beside 12 sums, so every FMA re-read
// one (12 loads + 3 broadcasts per 12 FMAs; 6 x 16 needs 2 loads + 6 broadcasts). With
// that and K transposed in 16-key blocks (below) the same prefill's attention went from
// 447-470 to 284-333 ms (alternating processes, 3 each).
#if defined(__AVX512F__)
constexpr int64_t kPR = 8;    // query rows per tile
constexpr int64_t kScoreRows = kPR, kVR = 4, kVL = 4 * kPL;
constexpr bool kScorePairs = true;
#else
constexpr int64_t kPR = 6;
constexpr int64_t kScoreRows = 6, kVR = 6, kVL = kPL;
constexpr bool kScorePairs = false;
#endif


template <typename T>
inline void prefill_fp32(const torch::Tensor& q, const KVRows<T>& K, const KVRows<T>& V,
                         int64_t KVH, int64_t full_ctx, float scale, torch::Tensor& out,
                         int64_t window, float softcap) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  // Below, keys are counted from w.k0 (0 without a window): ctx keys repacked, the first
  // query at `off`.
  const ChunkWindow w(n, full_ctx, window, kPL);
  const int64_t ctx = full_ctx - w.k0, kz = w.first - w.k0, pos0 = full_ctx - n;
  const int64_t G = H / KVH, off = ctx - n;
  const int64_t cp = (ctx + kPL - 1) / kPL * kPL;        // keys padded to whole tiles
  // The scores' row stride: an odd number of 64-byte lines, so that a tile's rows do not
  // share L1 sets (a multiple of 4 KB, 1,024 keys, put them all in one).
  const int64_t ks = (cp / kPL) % 2 == 0 ? cp + kPL : cp;
  const int64_t dp = (D + kPL - 1) / kPL * kPL;          // value lanes padded likewise
  // fp32 copies: K transposed in blocks of 16 keys, [KVH][cp / 16][D][16] (padding keys
  // are 0), so that a score tile's D x 16 keys are 4 KB in a row (as [KVH][D][cp] they were
  // D lines a key-row apart: at 1,024 keys all in one L1 set, and D streams for the
  // prefetcher); V [KVH][ctx][dp] (padding lanes are 0).
  const int64_t kb = cp / kPL;
  float* kt = scratch<float, 0>(KVH * D * cp);
  float* vf = scratch<float, 1>(KVH * ctx * dp);
  auto q32 = q.to(torch::kFloat32).contiguous();
  const float* qp = q32.data_ptr<float>();
  auto o32 = torch::empty({n, H, D}, q32.options());
  float* op = o32.data_ptr<float>();
  const int64_t tiles = (n + kPR - 1) / kPR, items = H * tiles;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < KVH * ctx; ++i) {
      const int64_t h = i / ctx, t = i % ctx;
      float* vo = vf + (h * ctx + t) * dp;
      if (t < kz) {                                        // behind every query's window
        for (int64_t d = 0; d < D; ++d) kt[((h * kb + t / kPL) * D + d) * kPL + t % kPL] = 0.f;
        for (int64_t d = 0; d < dp; ++d) vo[d] = 0.f;
        continue;
      }
      const T* kr = K.row(h, w.k0 + t);
      const T* vr = V.row(h, w.k0 + t);
      for (int64_t d = 0; d < D; ++d) {
        kt[((h * kb + t / kPL) * D + d) * kPL + t % kPL] = elem_f32(kr[d]);
        vo[d] = elem_f32(vr[d]);
      }
      for (int64_t d = D; d < dp; ++d) vo[d] = 0.f;
      if (t == ctx - 1)                                    // this head's padding keys
        for (int64_t d = 0; d < D; ++d)
          for (int64_t u = ctx; u < cp; ++u) kt[((h * kb + u / kPL) * D + d) * kPL + u % kPL] = 0.f;
    }
    float* sc = scratch<float, 2>(kPR * ks);
    // Later tiles see more keys: hand them out first, one at a time, so the threads finish
    // together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t tile = tiles - 1 - it / H, h = it % H, hk = h / G;
      const int64_t i0 = tile * kPR, rows = std::min<int64_t>(kPR, n - i0);
      const int64_t last = off + i0 + rows - 1;           // the tile's last visible key
      const int64_t tk = (last + kPL) / kPL * kPL;        // keys scored, whole tiles
      const int64_t ts = w.lo(pos0 + i0) / kPL * kPL;     // from its first row's window
      float qr[kPR][256];
      for (int64_t r = 0; r < kPR; ++r)
        for (int64_t d = 0; d < D; ++d)
          qr[r][d] = r < rows ? qp[((i0 + r) * H + h) * D + d] * scale : 0.f;
      const float* ktp = kt + hk * D * cp;
      // scores: q . k, kScoreRows query rows x 32 (or 16) keys a pass
      for (int64_t g0 = 0; g0 < kPR; g0 += kScoreRows)
        for (int64_t t0 = ts; t0 < tk; t0 += (kScorePairs ? 2 : 1) * kPL) {
          const bool two = kScorePairs && t0 + kPL < tk;
          float a1[kScoreRows][kPL], a2[kScoreRows][kPL];
          for (int64_t r = 0; r < kScoreRows; ++r)
#pragma omp simd
            for (int64_t l = 0; l < kPL; ++l) a1[r][l] = a2[r][l] = 0.f;
          if (two) {
            for (int64_t d = 0; d < D; ++d) {
              const float* kv = ktp + (t0 / kPL * D + d) * kPL;
              for (int64_t r = 0; r < kScoreRows; ++r) {
                const float qd = qr[g0 + r][d];
#pragma omp simd
                for (int64_t l = 0; l < kPL; ++l) {
                  a1[r][l] += qd * kv[l];
                  a2[r][l] += qd * kv[D * kPL + l];
                }
              }
            }
          } else {
            for (int64_t d = 0; d < D; ++d) {
              const float* kv = ktp + (t0 / kPL * D + d) * kPL;
              for (int64_t r = 0; r < kScoreRows; ++r) {
                const float qd = qr[g0 + r][d];
#pragma omp simd
                for (int64_t l = 0; l < kPL; ++l) a1[r][l] += qd * kv[l];
              }
            }
          }
          for (int64_t r = 0; r < kScoreRows; ++r) {
#pragma omp simd
            for (int64_t l = 0; l < kPL; ++l) sc[(g0 + r) * ks + t0 + l] = a1[r][l];
            if (two) {
#pragma omp simd
              for (int64_t l = 0; l < kPL; ++l) sc[(g0 + r) * ks + t0 + kPL + l] = a2[r][l];
            }
          }
        }
      // Softmax numerators and sums over each row's visible keys; keys outside them get
      // exactly 0 (their scores are never read, so no exp of a huge negative number either).
      float inv[kPR];
      for (int64_t r = 0; r < kPR; ++r) {
        float* s = sc + r * ks;
        const int64_t lo = r < rows ? w.lo(pos0 + i0 + r) : ts;
        const int64_t vis = std::min(off + i0 + r + 1, tk);
        if (softcap > 0.f) softcap_scores(s + lo, vis - lo, softcap);
        float m = s[lo];
        for (int64_t t = lo + 1; t < vis; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = lo; t < vis; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        for (int64_t t = ts; t < lo; ++t) s[t] = 0.f;
        for (int64_t t = vis; t < tk; ++t) s[t] = 0.f;
        inv[r] = 1.f / sum;
      }
      const float* vp = vf + hk * ctx * dp;
      const int64_t tv = std::min(tk, ctx);                // padding keys have p = 0
      // P . V: kVR rows x kVL value lanes a pass, each value row read once a pass; other
      // head sizes take several or partial lane blocks.
      for (int64_t r0 = 0; r0 < rows; r0 += kVR)
        for (int64_t d0 = 0; d0 < dp; d0 += kVL) {
          const int64_t lanes = std::min<int64_t>(kVL, dp - d0);
          float pv[kVR][kVL];
          for (int64_t r = 0; r < kVR; ++r)
#pragma omp simd
            for (int64_t l = 0; l < kVL; ++l) pv[r][l] = 0.f;
          if (lanes == kVL) {
            for (int64_t t = ts; t < tv; ++t) {
              const float* vr = vp + t * dp + d0;
              for (int64_t r = 0; r < kVR; ++r) {
                const float pr = sc[(r0 + r) * ks + t];
#pragma omp simd
                for (int64_t l = 0; l < kVL; ++l) pv[r][l] += pr * vr[l];
              }
            }
          } else {
            for (int64_t t = ts; t < tv; ++t) {
              const float* vr = vp + t * dp + d0;
              for (int64_t r = 0; r < kVR; ++r) {
                const float pr = sc[(r0 + r) * ks + t];
                for (int64_t l = 0; l < lanes; ++l) pv[r][l] += pr * vr[l];
              }
            }
          }
          for (int64_t r = 0; r < kVR && r0 + r < rows; ++r)
            for (int64_t l = 0; l < lanes && d0 + l < D; ++l)
              op[((i0 + r0 + r) * H + h) * D + d0 + l] = pv[r][l] * inv[r0 + r];
        }
    }
  }
  out = o32.to(q.scalar_type());
}


#if TL_PREFILL_BF16_DOT
static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// acc[r][c] += P pairs of row r (broadcast) . V pairs (NV vectors of 16 value lanes), over
// key pairs [u0, pairs): the P . V tile of 4 rows x NV * 16 lanes.
template <int NV>
static inline void pv_tile_bf16(const uint32_t* vp, int64_t dp, const uint16_t* pb,
                                int64_t cp, int64_t u0, int64_t pairs, int64_t d0,
                                __m512 (&acc)[4][4]) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t u = u0; u < pairs; ++u) {
    const uint32_t* vr = vp + u * dp + d0;
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = as_bh(_mm512_loadu_si512(vr + 16 * c));
    for (int r = 0; r < 4; ++r) {
      uint32_t pr;
      std::memcpy(&pr, pb + r * cp + 2 * u, sizeof(pr));
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pr)));
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, vv[c]);
    }
  }
}

// Key pair u (keys 2u, 2u + 1 counted from k0) of kv head h into the pair layouts of
// prefill_bf16_dot: a key row's 32-bit words are its d pairs (D is even), and the two value
// rows are interleaved by two 16-bit permutes per 32 lanes (a scalar loop for other head
// sizes). Keys before kz (behind every query's window, ChunkWindow) are zeros, not read.
static inline void repack_pair_bf16(const KVRows<uint16_t>& K, const KVRows<uint16_t>& V,
                                    int64_t h, int64_t u, int64_t ctx, int64_t D, int64_t dh,
                                    int64_t cp, int64_t dp, uint32_t* kp, uint32_t* vrow,
                                    const uint16_t* zeros, __m512i lo, __m512i hi, int64_t k0,
                                    int64_t kz) {
  const auto row_of = [&](const KVRows<uint16_t>& R, int64_t t) {
    return t < kz ? zeros : R.row(h, k0 + t);
  };
  const bool both = 2 * u + 1 < ctx;
  for (int64_t t = 2 * u; t < 2 * u + (both ? 2 : 1); ++t) {
    const uint16_t* row = row_of(K, t);
    for (int64_t j = 0; j < dh; ++j) {
      uint32_t w;
      std::memcpy(&w, row + 2 * j, sizeof(w));
      kp[j * cp + t] = w;
    }
  }
  const uint16_t* a = row_of(V, 2 * u);
  const uint16_t* b = both ? row_of(V, 2 * u + 1) : zeros;
  uint16_t* out = reinterpret_cast<uint16_t*>(vrow);
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    const __m512i ra = _mm512_loadu_si512(a + d), rb = _mm512_loadu_si512(b + d);
    _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(ra, lo, rb));
    _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(ra, hi, rb));
  }
  for (; d < D; ++d) { out[2 * d] = a[d]; out[2 * d + 1] = b[d]; }
  for (int64_t e = 2 * D; e < 2 * dp; ++e) out[e] = 0;   // padding lanes
}

// Layouts (uint32 = one bf16 pair): K as [KVH][D/2][cp] pairs along d (a 16-key load is
// 16 lanes of one d pair); V as [KVH][ctx/2][dp] pairs along keys (a 16-lane load is 16
// value lanes of one key pair); P per row as bf16 [cp], read two keys at a time. Padding
// keys, lanes and the odd key are zeros. Needs an even head size (the query's d pairs are
// its row's 32-bit words).
//
// The softmax takes the max and exp16 over each row's visible keys only and writes zeros
// around them, and P . V writes the bf16 output rows (the rounding o32.to(bf16) did).
// Keys are counted from the window's k0 (ChunkWindow), as in prefill_fp32.
inline void prefill_bf16_dot(const torch::Tensor& q, const KVRows<uint16_t>& K,
                             const KVRows<uint16_t>& V, int64_t KVH, int64_t full_ctx,
                             float scale, torch::Tensor& out, int64_t window, float softcap) {
  constexpr int64_t kSR = 8;    // query rows per score tile
  constexpr int64_t kSK = 32;   // keys per score tile (two vectors)
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const ChunkWindow w(n, full_ctx, window, kSK);
  const int64_t ctx = full_ctx - w.k0, kz = w.first - w.k0, pos0 = full_ctx - n;
  const int64_t G = H / KVH, off = ctx - n;
  const int64_t dh = D / 2, cp = (ctx + kSK - 1) / kSK * kSK;
  const int64_t cv = (ctx + 1) / 2, dp = (D + 15) / 16 * 16;
  uint32_t* kp = scratch<uint32_t, 3>(KVH * dh * cp);
  uint32_t* vp = scratch<uint32_t, 4>(KVH * cv * dp);
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q.data_ptr<at::BFloat16>());
  out = torch::empty({n, H, D}, q.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // lanes 0..31 of the interleave of rows a (even lanes) and b (odd lanes): a0 b0 a1 b1 ...
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 32; ++i) {
    lo_idx[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + i / 2);
    hi_idx[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + 16 + i / 2);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  alignas(64) const uint16_t zeros[256] = {};
  const int64_t tiles = (n + kSR - 1) / kSR, items = H * tiles;
  const __m512 sv = _mm512_set1_ps(scale);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < KVH * cv; ++i) {
      const int64_t h = i / cv, u = i % cv;
      uint32_t* kph = kp + h * dh * cp;
      repack_pair_bf16(K, V, h, u, ctx, D, dh, cp, dp, kph, vp + (h * cv + u) * dp, zeros,
                       lo, hi, w.k0, kz);
      if (u == cv - 1)                                     // this head's padding keys
        for (int64_t j = 0; j < dh; ++j)
          for (int64_t t = ctx; t < cp; ++t) kph[j * cp + t] = 0u;
    }
    float* sc = scratch<float, 5>(kSR * cp);
    uint16_t* pb = scratch<uint16_t, 6>(kSR * cp);
    alignas(64) uint32_t qr[kSR * 128];
    // Later tiles see more keys: hand them out first, one at a time, so the threads finish
    // together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t tile = tiles - 1 - it / H, h = it % H, hk = h / G;
      const int64_t i0 = tile * kSR, rows = std::min<int64_t>(kSR, n - i0);
      const int64_t first = off + i0;                      // the tile's first row's last key
      const int64_t tk = (first + rows - 1 + kSK) / kSK * kSK;   // keys scored, whole tiles
      const int64_t ts = w.lo(pos0 + i0) / kSK * kSK;      // from its first row's window
      for (int64_t r = 0; r < kSR; ++r) {
        if (r < rows) std::memcpy(qr + r * dh, qw + ((i0 + r) * H + h) * dh, dh * 4);
        else std::memset(qr + r * dh, 0, dh * 4);
      }
      const uint32_t* kpp = kp + hk * dh * cp;
      for (int64_t t0 = ts; t0 < tk; t0 += kSK) {          // scores: 8 rows x 32 keys a pass
        __m512 a0[kSR], a1[kSR];
        for (int64_t r = 0; r < kSR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < dh; ++j) {
          const uint32_t* kr = kpp + j * cp + t0;
          const __m512bh k0 = as_bh(_mm512_loadu_si512(kr));
          const __m512bh k1 = as_bh(_mm512_loadu_si512(kr + 16));
          for (int64_t r = 0; r < kSR; ++r) {
            const __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(qr[r * dh + j])));
            a0[r] = _mm512_dpbf16_ps(a0[r], qb, k0);
            a1[r] = _mm512_dpbf16_ps(a1[r], qb, k1);
          }
        }
        for (int64_t r = 0; r < kSR; ++r) {
          _mm512_storeu_ps(sc + r * cp + t0, _mm512_mul_ps(a0[r], sv));
          _mm512_storeu_ps(sc + r * cp + t0 + 16, _mm512_mul_ps(a1[r], sv));
        }
      }
      float inv[kSR];
      for (int64_t r = 0; r < kSR; ++r) {     // softmax numerators over the visible keys
        float* s = sc + r * cp;
        uint16_t* p = pb + r * cp;
        const int64_t from = r < rows ? w.lo(pos0 + i0 + r) : ts;   // (ts without a window)
        const int64_t vis = std::min(first + r + 1, tk);
        if (softcap > 0.f) softcap_scores(s + from, vis - from, softcap);
        // 16-key chunks from the one holding `from`, its lanes before `from` masked off
        const int64_t t1 = from / 16 * 16;
        const __mmask16 low = static_cast<__mmask16>(0xFFFFu << (from - t1));
        __m512 mx = _mm512_set1_ps(-3.0e38f);
        __mmask16 first_lanes = low;
        for (int64_t t = t1; t < vis; t += 16) {
          const int64_t left = vis - t;
          const __mmask16 m = (left >= 16 ? 0xFFFF : (1u << left) - 1) & first_lanes;
          first_lanes = 0xFFFF;
          mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(s + t));
        }
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        int64_t t = ts;
        for (; t < t1; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t),
                                                    _mm256_setzero_si256());
        first_lanes = low;
        for (; t < vis; t += 16) {
          const int64_t left = vis - t;
          const __mmask16 m = (left >= 16 ? 0xFFFF : (1u << left) - 1) & first_lanes;
          first_lanes = 0xFFFF;
          const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t),
                                                                      mv)));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        for (; t < tk; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t),
                                                    _mm256_setzero_si256());
        inv[r] = 1.f / _mm512_reduce_add_ps(sum);
      }
      const uint32_t* vpp = vp + hk * cv * dp;
      const int64_t pairs = std::min(tk / 2, cv);          // padding keys have p = 0
      const int64_t u0 = ts / 2;
      for (int64_t r0 = 0; r0 < kSR && r0 < rows; r0 += 4)
        for (int64_t d0 = 0; d0 < dp; d0 += 64) {
          __m512 acc[4][4];
          const int64_t nv = std::min<int64_t>(4, (dp - d0) / 16);
          const uint16_t* pr = pb + r0 * cp;
          switch (nv) {
            case 4: pv_tile_bf16<4>(vpp, dp, pr, cp, u0, pairs, d0, acc); break;
            case 3: pv_tile_bf16<3>(vpp, dp, pr, cp, u0, pairs, d0, acc); break;
            case 2: pv_tile_bf16<2>(vpp, dp, pr, cp, u0, pairs, d0, acc); break;
            default: pv_tile_bf16<1>(vpp, dp, pr, cp, u0, pairs, d0, acc); break;
          }
          for (int64_t r = 0; r < 4 && r0 + r < rows; ++r) {
            const __m512 iv = _mm512_set1_ps(inv[r0 + r]);
            uint16_t* orow = op + ((i0 + r0 + r) * H + h) * D + d0;
            for (int64_t c = 0; c < nv; ++c) {
              const int64_t left = D - d0 - 16 * c;       // lanes of the row still to write
              const __mmask16 m = left >= 16 ? 0xFFFF : (1u << left) - 1;
              _mm256_mask_storeu_epi16(orow + 16 * c, m,
                                       (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], iv)));
            }
          }
        }
    }
  }
}
#endif

// Whether bf16 prefill runs the vdpbf16ps kernel in this build (-march=native decides).
inline bool prefill_bf16_dot_built() { return TL_PREFILL_BF16_DOT; }

// The kernel for these rows: vdpbf16ps for bf16 where built (even head sizes), else fp32.
inline torch::Tensor prefill_dispatch(const torch::Tensor& q, const KVRows<uint16_t>& kb,
                                      const KVRows<uint16_t>& vb, const KVRows<float>& kf,
                                      const KVRows<float>& vf, int64_t KVH, int64_t ctx,
                                      double scale, int64_t window, float softcap) {
  torch::Tensor out;
  if (q.size(0) == 0) return torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
#if TL_PREFILL_BF16_DOT
    if (q.size(2) % 2 == 0) {
      prefill_bf16_dot(q, kb, vb, KVH, ctx, static_cast<float>(scale), out, window, softcap);
      return out;
    }
#endif
    KVRows<c10::BFloat16> k16{reinterpret_cast<const c10::BFloat16*>(kb.base), kb.s_head,
                              kb.s_tok, kb.table, kb.bs, kb.s_blk};
    KVRows<c10::BFloat16> v16{reinterpret_cast<const c10::BFloat16*>(vb.base), vb.s_head,
                              vb.s_tok, vb.table, vb.bs, vb.s_blk};
    prefill_fp32(q, k16, v16, KVH, ctx, static_cast<float>(scale), out, window, softcap);
    return out;
  }
  prefill_fp32(q, kf, vf, KVH, ctx, static_cast<float>(scale), out, window, softcap);
  return out;
}

inline void check_prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const char* what) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              what, ": fp32 or bf16");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), what, ": K and V in one dtype");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() ||
                  (q.scalar_type() == torch::kFloat32 &&
                   (k.scalar_type() == torch::kBFloat16 || k.scalar_type() == torch::kHalf)),
              what, ": K/V in the query's dtype, or bf16 / fp16 under an fp32 query");
  TORCH_CHECK(q.size(2) <= 256, what, ": head_dim up to 256");
}

// An fp32 query over bf16 or fp16 K/V (cache.kv_dtype bf16 / fp16 under an fp32 model): the
// fp32 kernel, its rows widened as it repacks them.
inline torch::Tensor prefill_widened(const torch::Tensor& q, const KVRows<uint16_t>& k,
                                     const KVRows<uint16_t>& v, at::ScalarType kv_dtype,
                                     int64_t KVH, int64_t ctx, double scale, int64_t window,
                                     float softcap) {
  torch::Tensor out;
  if (q.size(0) == 0) return torch::empty_like(q);
  auto as = [](const KVRows<uint16_t>& r, auto tag) {
    using E = decltype(tag);
    return KVRows<E>{reinterpret_cast<const E*>(r.base), r.s_head, r.s_tok, r.table, r.bs,
                   r.s_blk};
  };
  if (kv_dtype == torch::kBFloat16)
    prefill_fp32(q, as(k, c10::BFloat16{}), as(v, c10::BFloat16{}), KVH, ctx,
                 static_cast<float>(scale), out, window, softcap);
  else
    prefill_fp32(q, as(k, c10::Half{}), as(v, c10::Half{}), KVH, ctx, static_cast<float>(scale),
                 out, window, softcap);
  return out;
}

inline void check_options(int64_t window, double softcap, const char* what) {
  TORCH_CHECK(window >= 0 && softcap >= 0, what, ": window and softcap >= 0 (0: none)");
}

// q [n, H, D]; k, v [KVH, ctx, D] (any strides). window > 0: each query sees its last
// `window` keys (ChunkWindow); softcap > 0: soft-capped scores; 0: neither.
inline torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                       double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: 3-d tensors");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && q.size(1) % k.size(0) == 0,
              "prefill_attention: q [n, H, D], k and v [KVH, ctx, D], H a multiple of KVH");
  TORCH_CHECK(k.size(1) >= q.size(0), "prefill_attention: the context holds the queries");
  check_prefill(q, k, v, "prefill_attention");
  check_options(window, softcap, "prefill_attention");
  const float cap = static_cast<float>(softcap);
  q = q.contiguous();
  if (k.stride(2) != 1) k = k.contiguous();                // rows must be contiguous in d
  if (v.stride(2) != 1) v = v.contiguous();
  if (k.scalar_type() != q.scalar_type())
    return prefill_widened(q, view_rows<uint16_t>(k), view_rows<uint16_t>(v),
                                   k.scalar_type(), k.size(0), k.size(1), scale, window, cap);
  const bool bf = q.scalar_type() == torch::kBFloat16;
  KVRows<uint16_t> kb{}, vb{};
  KVRows<float> kf{}, vf{};
  if (bf) { kb = view_rows<uint16_t>(k); vb = view_rows<uint16_t>(v); }
  else { kf = view_rows<float>(k); vf = view_rows<float>(v); }
  return prefill_dispatch(q, kb, vb, kf, vf, k.size(0), k.size(1), scale, window, cap);
}

// q [n, H, D] at positions start_pos .. start_pos + n - 1; key_cache, value_cache
// [blocks, BS, KVH, D] (rows contiguous in d), already holding those positions' K/V;
// block_table int64 [>= ceil((start_pos + n) / BS)]; with a window, the entries of blocks
// wholly behind the first query's window are not read (nor checked).
inline torch::Tensor prefill_attention_paged(torch::Tensor q, torch::Tensor key_cache,
                                             torch::Tensor value_cache, torch::Tensor block_table,
                                             int64_t start_pos, double scale, int64_t window,
                                             double softcap) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "prefill_attention_paged: q [n, H, D], caches [blocks, BS, KVH, D]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.size(3) == q.size(2) &&
                  q.size(1) % key_cache.size(2) == 0,
              "prefill_attention_paged: caches [blocks, BS, KVH, D], H a multiple of KVH");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1 &&
                  key_cache.strides() == value_cache.strides(),
              "prefill_attention_paged: cache rows contiguous in d");
  check_prefill(q, key_cache, value_cache, "prefill_attention_paged");
  check_options(window, softcap, "prefill_attention_paged");
  const float cap = static_cast<float>(softcap);
  const int64_t ctx = start_pos + q.size(0), bs = key_cache.size(1);
  TORCH_CHECK(start_pos >= 0, "prefill_attention_paged: start_pos >= 0");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 1 &&
                  block_table.is_contiguous() && block_table.size(0) * bs >= ctx,
              "prefill_attention_paged: an int64 block table covering the context");
  const int64_t* tb = block_table.data_ptr<int64_t>();
  const int64_t first_block = ChunkWindow(q.size(0), ctx, window, 1).first / bs;
  for (int64_t i = first_block; i < (ctx + bs - 1) / bs; ++i)
    TORCH_CHECK(tb[i] >= 0 && tb[i] < key_cache.size(0),
                "prefill_attention_paged: block ", tb[i], " is outside the cache");
  q = q.contiguous();
  if (key_cache.scalar_type() != q.scalar_type())
    return prefill_widened(q, pool_rows<uint16_t>(key_cache, block_table),
                                   pool_rows<uint16_t>(value_cache, block_table),
                                   key_cache.scalar_type(), key_cache.size(2), ctx, scale,
                                   window, cap);
  const bool bf = q.scalar_type() == torch::kBFloat16;
  KVRows<uint16_t> kb{}, vb{};
  KVRows<float> kf{}, vf{};
  if (bf) {
    kb = pool_rows<uint16_t>(key_cache, block_table);
    vb = pool_rows<uint16_t>(value_cache, block_table);
  } else {
    kf = pool_rows<float>(key_cache, block_table);
    vf = pool_rows<float>(value_cache, block_table);
  }
  return prefill_dispatch(q, kb, vb, kf, vf, key_cache.size(2), ctx, scale, window, cap);
}
