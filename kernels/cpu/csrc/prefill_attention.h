// Causal prefill attention for the CPU (included by paged_decode_cpu.cpp): two kernels
// behind one entry point, prefill_attention().
//
// - prefill_fp32: fp32 arithmetic throughout, for fp32 models and for bf16 models on a CPU
//   without AVX512-BF16;
// - prefill_bf16_dot: bf16 models on a CPU with AVX512-BF16. Both products are vdpbf16ps
//   (two bf16 products summed into each fp32 lane per instruction: twice the fp32 FMA's work
//   per instruction), with the softmax in fp32 and its numerators rounded to bf16 before
//   P . V, as torch's own flash-attention kernel does for bf16 (so the rounding is the one
//   SDPA has in bf16 too). K and V are repacked once per call into the pair layout the
//   instruction reads.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TL_PREFILL_BF16_DOT 1
#else
#define TL_PREFILL_BF16_DOT 0
#endif

// Causal prefill attention over a contiguous context (fp32 or bf16; sums in fp32).
// q: [n, H, D]; k, v: [KVH, ctx, D] (any strides); query i sits at position ctx - n + i and
// sees keys 0 .. ctx - n + i. Returns [n, H, D] in q's dtype.
//
// torch's fused CPU SDPA ran a 1,024-token causal prefill of the default model (9 heads,
// D = 64) at about 85 GFLOP/s on 2 cores, 40% of the prefill's time. Here K is transposed
// once per call to [KVH][D][ctx] (fp32), so that a tile of kPR query rows x 16 keys is
// kPR x 16 accumulators updated by one 16-key load per d: the scores are a register-tiled
// GEMM, as is P . V (one 16-wide load of a value row per key, kPR FMAs with it). Each
// (head, row tile) is one work item; its scores (kPR x the tile's last key) are a
// per-thread scratch row, and the softmax is the plain two-pass one over them: no mask
// tensor, no materialised [n, ctx] score matrix.
constexpr int64_t kPR = 8;    // query rows per tile
constexpr int64_t kPL = 16;   // keys (score tile) / value lanes per vector
constexpr float kMasked = -1e30f;   // finite: -ffast-math assumes no infinities

inline void prefill_fp32(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  float scale, torch::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k.size(0), ctx = k.size(1), G = H / KVH, off = ctx - n;
  const int64_t cp = (ctx + kPL - 1) / kPL * kPL;        // keys padded to whole tiles
  const int64_t dp = (D + kPL - 1) / kPL * kPL;          // value lanes padded likewise
  // fp32 copies: K transposed [KVH][D][cp] (padding keys are 0), V [KVH][ctx][dp].
  std::vector<float> kt(KVH * D * cp, 0.f), vf(KVH * ctx * dp, 0.f);
  auto k32 = k.to(torch::kFloat32), v32 = v.to(torch::kFloat32);
  auto ka = k32.accessor<float, 3>(), va = v32.accessor<float, 3>();
  at::parallel_for(0, KVH * ctx, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / ctx, t = i % ctx;
      for (int64_t d = 0; d < D; ++d) {
        kt[(h * D + d) * cp + t] = ka[h][t][d];
        vf[(h * ctx + t) * dp + d] = va[h][t][d];
      }
    }
  });
  auto q32 = q.to(torch::kFloat32).contiguous();
  const float* qp = q32.data_ptr<float>();
  auto o32 = torch::empty({n, H, D}, q32.options());
  float* op = o32.data_ptr<float>();
  const int64_t tiles = (n + kPR - 1) / kPR, items = H * tiles;
  // Later tiles see more keys: hand them out first, one at a time, so the threads finish
  // together.
#pragma omp parallel
  {
    std::vector<float> sc(kPR * cp);
    float acc[kPR][kPL];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t tile = tiles - 1 - it / H, h = it % H, hk = h / G;
      const int64_t i0 = tile * kPR, rows = std::min<int64_t>(kPR, n - i0);
      const int64_t last = off + i0 + rows - 1;           // the tile's last visible key
      const int64_t tk = (last + kPL) / kPL * kPL;        // keys scored, whole tiles
      float qr[kPR][256];
      for (int64_t r = 0; r < kPR; ++r)
        for (int64_t d = 0; d < D; ++d)
          qr[r][d] = r < rows ? qp[((i0 + r) * H + h) * D + d] * scale : 0.f;
      const float* ktp = kt.data() + hk * D * cp;
      for (int64_t t0 = 0; t0 < tk; t0 += 2 * kPL) {      // scores: q . k, 32 keys a pass
        const bool two = t0 + kPL < tk;
        float acc2[kPR][kPL];
        for (int64_t r = 0; r < kPR; ++r)
#pragma omp simd
          for (int64_t l = 0; l < kPL; ++l) acc[r][l] = acc2[r][l] = 0.f;
        if (two) {
          for (int64_t d = 0; d < D; ++d) {
            const float* kv = ktp + d * cp + t0;
            for (int64_t r = 0; r < kPR; ++r) {
              const float qd = qr[r][d];
#pragma omp simd
              for (int64_t l = 0; l < kPL; ++l) {
                acc[r][l] += qd * kv[l];
                acc2[r][l] += qd * kv[kPL + l];
              }
            }
          }
        } else {
          for (int64_t d = 0; d < D; ++d) {
            const float* kv = ktp + d * cp + t0;
            for (int64_t r = 0; r < kPR; ++r) {
              const float qd = qr[r][d];
#pragma omp simd
              for (int64_t l = 0; l < kPL; ++l) acc[r][l] += qd * kv[l];
            }
          }
        }
        for (int64_t r = 0; r < kPR; ++r) {
          const int64_t visible = off + i0 + r;            // keys > visible are masked
#pragma omp simd
          for (int64_t l = 0; l < kPL; ++l)
            sc[r * cp + t0 + l] = t0 + l <= visible ? acc[r][l] : kMasked;
          if (two) {
#pragma omp simd
            for (int64_t l = 0; l < kPL; ++l)
              sc[r * cp + t0 + kPL + l] = t0 + kPL + l <= visible ? acc2[r][l] : kMasked;
          }
        }
      }
      float inv[kPR];
      for (int64_t r = 0; r < kPR; ++r) {                  // softmax numerators and sums
        float* s = sc.data() + r * cp;
        float m = kMasked;
        for (int64_t t = 0; t < tk; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < tk; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        inv[r] = 1.f / sum;
      }
      const float* vp = vf.data() + hk * ctx * dp;
      const int64_t tv = std::min(tk, ctx);                // padding keys have p = 0
      // P . V: 4 rows x 64 value lanes a pass (16 accumulators), each value row read once a
      // pass; other head sizes take several or partial lane blocks.
      constexpr int64_t kVR = 4, kVL = 4 * kPL;
      for (int64_t r0 = 0; r0 < rows; r0 += kVR)
        for (int64_t d0 = 0; d0 < dp; d0 += kVL) {
          const int64_t lanes = std::min<int64_t>(kVL, dp - d0);
          float pv[kVR][kVL];
          for (int64_t r = 0; r < kVR; ++r)
#pragma omp simd
            for (int64_t l = 0; l < kVL; ++l) pv[r][l] = 0.f;
          if (lanes == kVL) {
            for (int64_t t = 0; t < tv; ++t) {
              const float* vr = vp + t * dp + d0;
              for (int64_t r = 0; r < kVR; ++r) {
                const float pr = sc[(r0 + r) * cp + t];
#pragma omp simd
                for (int64_t l = 0; l < kVL; ++l) pv[r][l] += pr * vr[l];
              }
            }
          } else {
            for (int64_t t = 0; t < tv; ++t) {
              const float* vr = vp + t * dp + d0;
              for (int64_t r = 0; r < kVR; ++r) {
                const float pr = sc[(r0 + r) * cp + t];
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
// Two bf16 values as the 32-bit pair vdpbf16ps multiplies lane-wise: `lo` in the low half.
static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// acc[r][c] += P pairs of row r (broadcast) . V pairs (NV vectors of 16 value lanes), over
// key pairs [0, pairs): the P . V tile of kVR rows x NV * 16 lanes.
template <int NV>
static inline void pv_tile_bf16(const uint32_t* vp, int64_t dp, const uint16_t* pb,
                                int64_t cp, int64_t pairs, int64_t d0, __m512 (&acc)[4][4]) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < pairs; ++u) {
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

// K and V into the pair layouts below. Rows contiguous in d (the usual case: a view of
// the cache's [ctx, KVH, D] rows) go through raw pointers: a key row's 32-bit words are
// its d pairs, and a pair of value rows is interleaved by two 16-bit permutes per 32
// lanes. Repacked per call, so its cost is per layer whatever the chunk: through tensor
// accessors it was a fixed ~0.1 ms a layer, most of a small continuation chunk's
// attention.
static inline void repack_bf16(const torch::Tensor& k, const torch::Tensor& v, uint32_t* kp,
                               uint32_t* vp, int64_t dh, int64_t cp, int64_t cv, int64_t dp) {
  const int64_t KVH = k.size(0), ctx = k.size(1), D = k.size(2);
  if (k.stride(2) != 1 || v.stride(2) != 1 || D % 32 != 0) {
    auto ka = k.accessor<at::BFloat16, 3>(), va = v.accessor<at::BFloat16, 3>();
    at::parallel_for(0, KVH * ctx, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h = i / ctx, t = i % ctx;
        for (int64_t j = 0; j < dh; ++j)
          kp[(h * dh + j) * cp + t] =
              bf16_pair(ka[h][t][2 * j].x, 2 * j + 1 < D ? ka[h][t][2 * j + 1].x : 0);
        uint16_t* vrow = reinterpret_cast<uint16_t*>(vp + (h * cv + t / 2) * dp);
        for (int64_t d = 0; d < D; ++d) vrow[2 * d + (t & 1)] = va[h][t][d].x;
      }
    });
    return;
  }
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  // lanes 0..31 of the interleave of rows a (even lanes) and b (odd lanes): a0 b0 a1 b1 ...
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 32; ++i) {
    lo_idx[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + i / 2);
    hi_idx[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + 16 + i / 2);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  at::parallel_for(0, KVH * cv, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / cv, u = i % cv;
      for (int64_t t = 2 * u; t < std::min(ctx, 2 * u + 2); ++t) {   // K: words to columns
        const uint16_t* row = kb + h * ks0 + t * ks1;
        for (int64_t j = 0; j < dh; ++j) {
          uint32_t w;
          std::memcpy(&w, row + 2 * j, sizeof(w));
          kp[(h * dh + j) * cp + t] = w;
        }
      }
      const uint16_t* a = vb + h * vs0 + 2 * u * vs1;                 // V: rows 2u, 2u + 1
      uint16_t* out = reinterpret_cast<uint16_t*>(vp + (h * cv + u) * dp);
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i ra = _mm512_loadu_si512(a + d);
        const __m512i rb = 2 * u + 1 < ctx ? _mm512_loadu_si512(a + vs1 + d)
                                           : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(ra, lo, rb));
        _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(ra, hi, rb));
      }
    }
  });
}

// Layouts (uint32 = one bf16 pair): K as [KVH][D/2][cp] pairs along d (a 16-key load is
// 16 lanes of one d pair); V as [KVH][ctx/2][dp] pairs along keys (a 16-lane load is 16
// value lanes of one key pair); P per row as bf16 [cp], read two keys at a time. Padding
// keys, lanes and the odd d or key are zeros.
inline void prefill_bf16_dot(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, float scale, torch::Tensor& out) {
  constexpr int64_t kSR = 8;    // query rows per score tile
  constexpr int64_t kSK = 32;   // keys per score tile (two vectors)
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k.size(0), ctx = k.size(1), G = H / KVH, off = ctx - n;
  const int64_t dh = (D + 1) / 2, cp = (ctx + kSK - 1) / kSK * kSK;
  const int64_t cv = (ctx + 1) / 2, dp = (D + 15) / 16 * 16;
  std::vector<uint32_t> kp(KVH * dh * cp, 0u), vp(KVH * cv * dp, 0u);
  repack_bf16(k, v, kp.data(), vp.data(), dh, cp, cv, dp);
  auto qc = q.contiguous();
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  auto o32 = torch::empty({n, H, D}, q.options().dtype(torch::kFloat32));
  float* op = o32.data_ptr<float>();
  const int64_t tiles = (n + kSR - 1) / kSR, items = H * tiles;
#pragma omp parallel
  {
    std::vector<float> sc(kSR * cp);
    std::vector<uint16_t> pb(kSR * cp);
    std::vector<uint32_t> qr(kSR * dh);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t tile = tiles - 1 - it / H, h = it % H, hk = h / G;
      const int64_t i0 = tile * kSR, rows = std::min<int64_t>(kSR, n - i0);
      const int64_t last = off + i0 + rows - 1;            // the tile's last visible key
      const int64_t tk = (last + kSK) / kSK * kSK;         // keys scored, whole tiles
      for (int64_t r = 0; r < kSR; ++r)
        for (int64_t j = 0; j < dh; ++j) {
          const uint16_t* qrow = qp + ((i0 + r) * H + h) * D;
          qr[r * dh + j] = r < rows ? bf16_pair(qrow[2 * j], 2 * j + 1 < D ? qrow[2 * j + 1] : 0)
                                    : 0u;
        }
      const uint32_t* kpp = kp.data() + hk * dh * cp;
      const __m512 sv = _mm512_set1_ps(scale);
      for (int64_t t0 = 0; t0 < tk; t0 += kSK) {           // scores: 8 rows x 32 keys a pass
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
          _mm512_storeu_ps(sc.data() + r * cp + t0, _mm512_mul_ps(a0[r], sv));
          _mm512_storeu_ps(sc.data() + r * cp + t0 + 16, _mm512_mul_ps(a1[r], sv));
        }
      }
      float inv[kSR];
      for (int64_t r = 0; r < kSR; ++r) {                  // softmax numerators and sums
        float* s = sc.data() + r * cp;
        for (int64_t t = off + i0 + r + 1; t < tk; ++t) s[t] = kMasked;   // later keys
        float m = kMasked;
        for (int64_t t = 0; t < tk; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < tk; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        inv[r] = 1.f / sum;
        uint16_t* p = pb.data() + r * cp;
        for (int64_t t = 0; t < tk; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
      }
      const uint32_t* vpp = vp.data() + hk * cv * dp;
      const int64_t pairs = std::min(tk / 2, cv);          // padding keys have p = 0
      for (int64_t r0 = 0; r0 < kSR && r0 < rows; r0 += 4)
        for (int64_t d0 = 0; d0 < dp; d0 += 64) {
          __m512 acc[4][4];
          const int64_t nv = std::min<int64_t>(4, (dp - d0) / 16);
          const uint16_t* pr = pb.data() + r0 * cp;
          switch (nv) {
            case 4: pv_tile_bf16<4>(vpp, dp, pr, cp, pairs, d0, acc); break;
            case 3: pv_tile_bf16<3>(vpp, dp, pr, cp, pairs, d0, acc); break;
            case 2: pv_tile_bf16<2>(vpp, dp, pr, cp, pairs, d0, acc); break;
            default: pv_tile_bf16<1>(vpp, dp, pr, cp, pairs, d0, acc); break;
          }
          for (int64_t r = 0; r < 4 && r0 + r < rows; ++r) {
            float lanes[64];
            for (int64_t c = 0; c < nv; ++c)
              _mm512_storeu_ps(lanes + 16 * c, _mm512_mul_ps(acc[r][c],
                                                             _mm512_set1_ps(inv[r0 + r])));
            float* orow = op + ((i0 + r0 + r) * H + h) * D;
            for (int64_t l = 0; l < 16 * nv && d0 + l < D; ++l) orow[d0 + l] = lanes[l];
          }
        }
    }
  }
  out = o32.to(q.scalar_type());
}
#endif

// Whether bf16 prefill runs the vdpbf16ps kernel in this build (-march=native decides).
inline bool prefill_bf16_dot_built() { return TL_PREFILL_BF16_DOT; }

inline torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: 3-d tensors");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && q.size(1) % k.size(0) == 0,
              "prefill_attention: q [n, H, D], k and v [KVH, ctx, D], H a multiple of KVH");
  TORCH_CHECK(k.size(1) >= q.size(0), "prefill_attention: the context holds the queries");
  TORCH_CHECK(q.size(2) <= 256, "prefill_attention: head_dim up to 256");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              "prefill_attention: fp32 or bf16");
  torch::Tensor out;
  if (q.size(0) == 0) return torch::empty_like(q);
#if TL_PREFILL_BF16_DOT
  if (q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
      v.scalar_type() == torch::kBFloat16) {
    prefill_bf16_dot(q, k, v, static_cast<float>(scale), out);
    return out;
  }
#endif
  prefill_fp32(q, k, v, static_cast<float>(scale), out);
  return out;
}

