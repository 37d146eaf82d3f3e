// y[M, N] = x[M, K] . W[N, K]^T (+ bias) with W in 32-weight blocks, as GGUF stores them:
//
//   q4: 16 bytes of nibbles + an fp16 scale d + an fp16 min m per block (GGUF Q4_1; Q4_0 is
//       the same with m = -8 d). Byte j of a block holds weight j in its low nibble and
//       weight j + 16 in its high nibble. w = d * q + m.
//   q8: 32 int8 + an fp16 scale d per block (GGUF Q8_0). w = d * q.
//
// The weights are read once per call whatever M: every call walks W a few rows at a time
// and multiplies each block with every activation row while it is in L1. So a decode step streams 0.625 (q4) or 1.0625 (q8) bytes per weight, and a prefill chunk never
// dequantizes the whole matrix.
//
// The activations are quantized per call to int8 blocks of 32 (scale dx = max|x| / 127), as
// llama.cpp does for these formats: a block's 32 products are then summed exactly in
// integers, and sum_j (d q_j + m) x_j = d dx sum_j q_j xq_j + m dx sum_j xq_j. Widening
// every weight to fp32 instead measured compute-bound on a 2-core AVX2 machine (29 ms a
// step for 96 MB of q4 weights, slower than fp32's 35 ms for 538 MB).
//
// Three paths over the same integer blocks, chosen by what the compiler targets
// (-march=native):
//   AVX-512 VNNI (vpdpbusd u8 x s8 -> s32): register tiles of weight rows x activation rows
//     (4 x up to 3 for decode rows, 2 x up to 6 above), each weight vector prepared once for
//     the tile's activation rows, the tile's rows prefetched ahead. Two operators:
//     q4_gemm / q8_gemm read the blocks as GGUF lays them out, two blocks a vector, each
//     block's partial sums scaled per vector; q4_gemm_packed / q8_gemm_packed read
//     blocks.pack_groups' layout, where one 64-byte load holds 4 codes of each of 16 blocks:
//     8 vpdpbusd leave every block's whole sum in its own lane, and the scales multiply
//     once per 16 blocks.
//   AVX2 (+FMA, F16C): one weight row against up to 4 activation rows (maddubs / madd),
//     each block converted and scaled; over the packed layout, tile_avx2: each block's sum
//     kept in an int32 lane across the group, the scales applied once per 8 blocks.
//   plain loops otherwise.
// Interleaved on a 2-core Zen 4, 30 layers of the default model's projections, AVX2 ->
// packed VNNI: q4 1 row 4.1-4.4 -> 2.8-3.1 ms, 16 rows 29.6 -> 18.8, 64 rows 111 -> 68;
// q8 16 rows 30.2 -> 18.9, 64 rows 110 -> 69 (1 row ~4.5-5 ms both: the read bandwidth).
// Whether this kernel or a kept dequantized copy serves a row count is measured at start-up
// (kernels/cpu/linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>
#include <cmath>
#include <memory>

#include "team.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TL_AVX2 1
#endif
#if defined(TL_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TL_VNNI 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMRows = 4;   // activation rows per pass over a weight row

enum class Fmt { Q4, Q8 };

inline float half_to_float(uint16_t h) {
#if defined(TL_AVX2)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

#if defined(TL_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [sum(a), sum(b), sum(c), sum(d)]: pairs added within each 128-bit half, then the halves.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One weight row against MS activation rows quantized to int8 blocks (xq, with scale dx and
// dx * sum(xq) per block, as llama.cpp's Q8_1): the 32 products of a block are summed
// exactly in integers (maddubs: u8 x s8 -> s16 pairs, then madd -> s32), converted once and
// scaled by d_w * d_x. A 4-bit code times an int8 is at most 15 * 127 * 2 per pair, an 8-bit
// product pair at most 127 * 127 * 2: neither saturates int16.
template <Fmt F, int MS>
inline void row_dot(const uint8_t* q, const uint16_t* d, const uint16_t* mn, const int8_t* xq,
                    const float* dx, const float* sx, int64_t K, int64_t nb, float* out,
                    int64_t blocks = -1) {
  // nb: the stride of dx / sx rows; blocks: how many to sum (all nb unless given)
  if (blocks < 0) blocks = nb;
  __m256 acc[MS];
  float macc[MS];
  for (int m = 0; m < MS; ++m) { acc[m] = _mm256_setzero_ps(); macc[m] = 0.f; }
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i w;   // Q4: codes 0..15 (unsigned); Q8: |w| with the signs moved onto x below
    __m256i sign;
    if constexpr (F == Fmt::Q4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
    } else {
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
      w = _mm256_sign_epi8(sign, sign);
    }
    const float dw = half_to_float(d[b]);
    for (int m = 0; m < MS; ++m) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * kBlock));
      if constexpr (F == Fmt::Q8) xv = _mm256_sign_epi8(xv, sign);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[m * nb + b]), _mm256_cvtepi32_ps(p),
                               acc[m]);
    }
    if constexpr (F == Fmt::Q4) {
      const float mv = half_to_float(mn[b]);
      for (int m = 0; m < MS; ++m) macc[m] += mv * sx[m * nb + b];
    }
  }
  for (int m = 0; m < MS; ++m) out[m] = hsum(acc[m]) + macc[m];
}
#else
// Plain loops over the same int8 activation blocks.
template <Fmt F, int MS>
inline void row_dot(const uint8_t* q, const uint16_t* d, const uint16_t* mn, const int8_t* xq,
                    const float* dx, const float* sx, int64_t K, int64_t nb, float* out,
                    int64_t blocks = -1) {
  // nb: the stride of dx / sx rows; blocks: how many to sum (all nb unless given)
  if (blocks < 0) blocks = nb;
  float acc[MS] = {};
  float w[kBlock];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int j = 0; j < 16; ++j) {
      if constexpr (F == Fmt::Q4) {
        const uint8_t byte = q[b * 16 + j];
        w[j] = static_cast<float>(byte & 0x0F);
        w[j + 16] = static_cast<float>(byte >> 4);
      } else {
        const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * kBlock;
        w[j] = static_cast<float>(qb[j]);
        w[j + 16] = static_cast<float>(qb[j + 16]);
      }
    }
    const float dv = half_to_float(d[b]);
    const float mv = F == Fmt::Q4 ? half_to_float(mn[b]) : 0.f;
    for (int m = 0; m < MS; ++m) {
      const int8_t* xb = xq + m * K + b * kBlock;
      float p = 0.f;
      for (int j = 0; j < kBlock; ++j) p += w[j] * static_cast<float>(xb[j]);
      acc[m] += dv * dx[m * nb + b] * p + (F == Fmt::Q4 ? mv * sx[m * nb + b] : 0.f);
    }
  }
  for (int m = 0; m < MS; ++m) out[m] = acc[m];
}
#endif

template <Fmt F>
inline void dispatch(int64_t ms, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
                     const int8_t* xq, const float* dx, const float* sx, int64_t K, int64_t nb,
                     float* out) {
  switch (ms) {
    case 1: row_dot<F, 1>(q, d, mn, xq, dx, sx, K, nb, out); break;
    case 2: row_dot<F, 2>(q, d, mn, xq, dx, sx, K, nb, out); break;
    case 3: row_dot<F, 3>(q, d, mn, xq, dx, sx, K, nb, out); break;
    default: row_dot<F, 4>(q, d, mn, xq, dx, sx, K, nb, out); break;
  }
}

// x rows -> int8 blocks: dx = max|x| / 127, xq = round(x / dx), sx = dx * sum(xq).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = x + i * kBlock;   // rows are contiguous: block i of the whole matrix
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float dv = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
        xq[i * kBlock + j] = static_cast<int8_t>(v);
        sum += v;
      }
      dx[i] = dv;
      sx[i] = dv * static_cast<float>(sum);
    }
  });
}

// ---- One tile driver for every ISA ------------------------------------------------------
//
// `Tile` names an ISA's tile kernel: `Tile::X` is its quantized activations (with M, K, nb)
// and `Tile::template run<F, RN, RM>(q, q_row, d, mn, nb, x, m0, out)` computes
// out[m * RN + n] = weight row n . activation row m0 + m (without bias) for RN rows of the
// packed weights (q_row bytes apart) against RM activation rows.

template <class Tile, Fmt F, int RN, int RMAX>
inline void tile_rows(int64_t rm, const uint8_t* q, int64_t q_row, const uint16_t* d,
                      const uint16_t* mn, int64_t nb, const typename Tile::X& x, int64_t m0,
                      float* out) {
  static_assert(RMAX <= 6, "tile_rows: up to 6 activation rows");
  switch (rm) {
    case 1: Tile::template run<F, RN, 1>(q, q_row, d, mn, nb, x, m0, out); break;
    case 2: if constexpr (RMAX >= 2) Tile::template run<F, RN, 2>(q, q_row, d, mn, nb, x, m0, out); break;
    case 3: if constexpr (RMAX >= 3) Tile::template run<F, RN, 3>(q, q_row, d, mn, nb, x, m0, out); break;
    case 4: if constexpr (RMAX >= 4) Tile::template run<F, RN, 4>(q, q_row, d, mn, nb, x, m0, out); break;
    case 5: if constexpr (RMAX >= 5) Tile::template run<F, RN, 5>(q, q_row, d, mn, nb, x, m0, out); break;
    default: if constexpr (RMAX >= 6) Tile::template run<F, RN, 6>(q, q_row, d, mn, nb, x, m0, out); break;
  }
}

// Tiles [begin, end) of y. Not inlined: the operator's threads and the decode stack's team
// (team.h) run this one compiled body, so that their results are bit-identical (-ffast-math
// lets two inlined copies order a sum differently).
template <class Tile, Fmt F, int RN, int RMAX>
__attribute__((noinline)) void tiles(const typename Tile::X& x, const uint8_t* q,
                                     const uint16_t* d, const uint16_t* mn, const float* bias,
                                     float* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t M = x.M, nb = x.nb, q_row = F == Fmt::Q4 ? x.K / 2 : x.K;
  float out[RN * RMAX];
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * RN;
    const int64_t rn = std::min<int64_t>(RN, N - n0);
    const uint8_t* qn = q + n0 * q_row;
    const uint16_t* dn = d + n0 * nb;
    const uint16_t* mnn = mn ? mn + n0 * nb : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += RMAX) {
      const int64_t rm = std::min<int64_t>(RMAX, M - m0);
      if (rn == RN) {
        tile_rows<Tile, F, RN, RMAX>(rm, qn, q_row, dn, mnn, nb, x, m0, out);
      } else {   // the last rows of an N that is not a multiple of RN, one at a time
        for (int64_t n = 0; n < rn; ++n) {
          float one[RMAX];
          tile_rows<Tile, F, 1, RMAX>(rm, qn + n * q_row, q_row, dn + n * nb,
                                      mnn ? mnn + n * nb : nullptr, nb, x, m0, one);
          for (int64_t m = 0; m < rm; ++m) out[m * rn + n] = one[m];
        }
      }
      for (int64_t m = 0; m < rm; ++m)
        for (int64_t n = 0; n < rn; ++n)
          y[(m0 + m) * N + n0 + n] = out[m * rn + n] + (bias ? bias[n0 + n] : 0.f);
    }
  }
}

// Tiles of RN weight rows x up to RMAX activation rows; each thread takes a range of tiles
// and runs every activation row through a tile while its weights are in L1. parts == 0:
// at::parallel_for over all tiles; else share `part` of `parts` on this thread (a caller's
// OpenMP team, team.h).
template <class Tile, Fmt F, int RN, int RMAX>
void drive(const typename Tile::X& x, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
           const float* bias, float* y, int64_t N, int part = 0, int parts = 0) {
  const int64_t n_tiles = (N + RN - 1) / RN;
  auto go = [&](int64_t begin, int64_t end) {
    tiles<Tile, F, RN, RMAX>(x, q, d, mn, bias, y, N, begin, end);
  };
  // 32 weight rows per task at least: enough to balance a few dozen threads.
  if (parts == 0) at::parallel_for(0, n_tiles, (32 + RN - 1) / RN, go);
  else go(n_tiles * part / parts, n_tiles * (part + 1) / parts);
}

#if defined(TL_VNNI)
// ---- AVX-512 VNNI path -------------------------------------------------------------------
//
// vpdpbusd multiplies unsigned bytes by signed bytes and sums each 4 products into an int32
// lane, exactly. Blocks as GGUF stores them (and the tail of a packed row): a zmm holds two
// blocks, its 16 lanes two blocks' partial sums, each scaled by its block's d_w * d_x before
// the fp32 accumulation. Packed groups: see q4_gemm_packed. q4 codes are unsigned
// already; a q8 code w is read as u = w ^ 0x80 = w + 128 (so sum u xq = sum w xq +
// 128 sum xq), which makes Q8_0 a block with min -128 d: the same "+ m dx sum(xq)" term as
// Q4_1's, added from dx sum(xq) (sx) after the main loop.
//
// q4's nibbles: a pair of blocks' 32 bytes is loaded into both halves of a zmm and the upper
// half shifted by 4, so the vector holds [lo(b0) lo(b1) hi(b0) hi(b1)] (16 codes each); the
// activations are quantized into the same order, so no shuffle runs in the inner loop.

// Weight rows ahead of a tile that it prefetches (see tile_vnni).
constexpr int kPrefetchRows = 8;

// The activations of one call, quantized for this path. With `groups` > 0 (the packed
// layout, blocks.pack_groups) the first 16 * groups blocks of a row are interleaved as the
// packed weights are; the rest (the tail) is in pairs as below.
struct VnniX {
  int64_t M, K, nb, groups, np, sx_row;
  std::unique_ptr<int8_t[]> xq;   // [M, K]
  std::unique_ptr<float[]> dxn;   // [M, sx_row]: each block's scale
  std::unique_ptr<float[]> dxv;   // [M, np, 16]: each tail pair's two scales spread over lanes
  std::unique_ptr<float[]> sx;    // [M, sx_row]: dx * sum(xq) per block, zero-padded to 16
};

// 32 floats -> 32 int8 codes, code j written to out[pos(j)]; returns dx, sets *sum = sum of
// the codes. The same arithmetic as quantize_rows.
template <typename Pos>
inline float quantize_block(const float* xb, Pos pos, int8_t* out, int* sum) {
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  // cvtps rounds to nearest even, as nearbyint does in the default rounding mode
  const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv));
  const __m512i ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
  alignas(64) int8_t codes[32];
  _mm_store_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtsepi32_epi8(ia));
  _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtsepi32_epi8(ib));
  for (int j = 0; j < 32; j += 4) std::memcpy(out + pos(j), codes + j, 4);
  return amax / 127.f;
}

VnniX alloc_vnni(int64_t M, int64_t K, int64_t groups) {
  VnniX v;
  v.M = M; v.K = K; v.nb = K / kBlock; v.groups = groups;
  v.np = (v.nb - groups * 16) / 2;
  v.sx_row = (v.nb + 15) / 16 * 16;
  v.xq.reset(new int8_t[M * K]);
  v.dxn.reset(new float[M * v.sx_row]);
  v.dxv.reset(new float[std::max<int64_t>(1, M * v.np * 16)]);
  v.sx.reset(new float[M * v.sx_row]);
  return v;
}

// x's M rows into v (allocated by alloc_vnni for them).
template <Fmt F>
void quantize_vnni_into(VnniX& v, const float* x) {
  const int64_t M = v.M, K = v.K, b0 = v.groups * 16;   // b0: the tail's first block
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = x + m * K;
      int8_t* qr = v.xq.get() + m * K;
      float* sxr = v.sx.get() + m * v.sx_row;
      float* dxr = v.dxn.get() + m * v.sx_row;
      for (int64_t b = v.nb; b < v.sx_row; ++b) sxr[b] = dxr[b] = 0.f;
      for (int64_t b = 0; b < v.nb; ++b) {
        int s;
        float dv;
        if (b < b0) {          // packed: code j of block i -> chunk j/4, lane i
          const int64_t i = b % 16;
          dv = quantize_block(xr + b * kBlock, [i](int j) { return (j / 4) * 64 + i * 4 + j % 4; },
                              qr + (b / 16) * 512, &s);
        } else if (F == Fmt::Q4 && b - b0 < 2 * v.np) {
          // a q4 pair: [lo(b0) lo(b1) hi(b0) hi(b1)], 16 codes each
          const bool first = (b - b0) % 2 == 0;
          dv = quantize_block(xr + b * kBlock,
                              [first](int j) { return (j < 16 ? 0 : 32) + (first ? 0 : 16) +
                                                      j % 16; },
                              qr + b0 * kBlock + (b - b0) / 2 * 64, &s);
        } else {               // q8 pairs and a lone last block: natural order
          dv = quantize_block(xr + b * kBlock, [](int j) { return j; }, qr + b * kBlock, &s);
        }
        sxr[b] = dv * static_cast<float>(s);
        dxr[b] = dv;
      }
      for (int64_t p = 0; p < v.np; ++p) {
        float* dv = v.dxv.get() + (m * v.np + p) * 16;
        for (int l = 0; l < 16; ++l) {   // lane l belongs to block 0 or 1 of the pair
          const int blk = F == Fmt::Q4 ? (l / 4) & 1 : l / 8;
          dv[l] = dxr[b0 + 2 * p + blk];
        }
      }
    }
  });
}

template <Fmt F>
VnniX quantize_vnni(const float* x, int64_t M, int64_t K, int64_t groups) {
  VnniX v = alloc_vnni(M, K, groups);
  quantize_vnni_into<F>(v, x);
  return v;
}

// The scales of blocks 2p, 2p+1 of a weight row, spread over the lanes as dxv is.
template <Fmt F>
inline __m512 pair_scales(const uint16_t* d, const __m512i pattern) {
  uint32_t two;
  std::memcpy(&two, d, 4);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)));
  return _mm512_permutexvar_ps(pattern, _mm512_castps128_ps512(f));
}

template <Fmt F>
inline __m512i pair_codes(const uint8_t* q) {
  if constexpr (F == Fmt::Q4) {
    const __m512i raw = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m512i shifted = _mm512_srlv_epi64(raw, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_xor_si512(_mm512_loadu_si512(q), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}

// [sum(a), sum(b), sum(c), sum(d)] of four 16-lane vectors.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a, b, c, d]
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                     _mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[m * RN + n] = sum over K of row n of the weights . activation row m (without bias).
template <Fmt F, int RN, int RM>
inline void tile_vnni(const uint8_t* q, int64_t q_row, const uint16_t* d, const uint16_t* mn,
                      int64_t nb, const VnniX& x, int64_t m0, float* out) {
  __m512 acc[RN][RM];
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc[n][m] = _mm512_setzero_ps();
  const int64_t K = x.K, np = x.np, groups = x.groups;
  const int8_t* xq = x.xq.get() + m0 * K;
  // The tile reads RN rows side by side: RN short streams (a q8 row of the default model is
  // 9 cache lines), which the hardware prefetcher follows badly. So the tile prefetches the
  // rows kPrefetchRows ahead as fast as it consumes its own (at one activation row, 4 and 16
  // rows ahead measured 5-10% slower than 8).
  const uint8_t* ahead = q + kPrefetchRows * q_row;
  constexpr int64_t group_bytes = F == Fmt::Q4 ? 256 : 512;
  // Groups of 16 blocks (packed): 8 vpdpbusd a row pair sum each block in its own lane, so the
  // scales multiply once per 16 blocks.
  for (int64_t g = 0; g < groups; ++g) {
    __m512i iacc[RN][RM];
    for (int n = 0; n < RN; ++n)
      for (int m = 0; m < RM; ++m) iacc[n][m] = _mm512_setzero_si512();
    for (int64_t l = 0; l < RN * group_bytes / 64; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + g * RN * group_bytes + l * 64),
                   _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {   // chunks 0-3, then 4-7: 4 code vectors a row live
      for (int c = half * 4; c < half * 4 + 4; ++c) {
        __m512i w[RN];
        for (int n = 0; n < RN; ++n) {
          const uint8_t* gp = q + n * q_row + g * group_bytes;
          if constexpr (F == Fmt::Q4) {
            const __m512i raw = _mm512_loadu_si512(gp + (c % 4) * 64);
            w[n] = _mm512_and_si512(half ? _mm512_srli_epi16(raw, 4) : raw,
                                    _mm512_set1_epi8(0x0F));
          } else {
            w[n] = _mm512_xor_si512(_mm512_loadu_si512(gp + c * 64),
                                    _mm512_set1_epi8(static_cast<char>(0x80)));
          }
        }
        __m512i xv[RM];   // in registers: each is used RN times (from L2 when M is large)
        for (int m = 0; m < RM; ++m) xv[m] = _mm512_loadu_si512(xq + m * K + g * 512 + c * 64);
        for (int m = 0; m < RM; ++m)
          for (int n = 0; n < RN; ++n) iacc[n][m] = _mm512_dpbusd_epi32(iacc[n][m], w[n], xv[m]);
      }
    }
    for (int n = 0; n < RN; ++n) {
      const __m512 dw = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + n * nb + g * 16)));
      for (int m = 0; m < RM; ++m) {
        const __m512 dxm = _mm512_loadu_ps(x.dxn.get() + (m0 + m) * x.sx_row + g * 16);
        acc[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[n][m]), _mm512_mul_ps(dw, dxm),
                                    acc[n][m]);
      }
    }
  }
  // The tail (every block when unpacked): pairs of blocks, two a vector.
  const int64_t b0 = groups * 16;
  const uint8_t* qt = q + groups * group_bytes;
  const uint16_t* dt = d + b0;
  const int8_t* xt = xq + b0 * kBlock;
  const __m512i pattern = F == Fmt::Q4
      ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
      : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t pair_bytes = F == Fmt::Q4 ? 32 : 64;
  const float* dxv = x.dxv.get() + m0 * np * 16;
  const uint8_t* ahead_t = ahead + groups * RN * group_bytes;
  const int64_t lines = RN * pair_bytes / 64;
  for (int64_t p = 0; p < np; ++p) {
    for (int64_t l = 0; l < lines; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(ahead_t + (p * lines + l) * 64), _MM_HINT_T0);
    __m512i w[RN];
    __m512 dw[RN];
    for (int n = 0; n < RN; ++n) {
      w[n] = pair_codes<F>(qt + n * q_row + p * pair_bytes);
      dw[n] = pair_scales<F>(dt + n * nb + 2 * p, pattern);
    }
    for (int m = 0; m < RM; ++m) {
      const __m512i xv = _mm512_loadu_si512(xt + m * K + p * 64);
      const __m512 dxm = _mm512_loadu_ps(dxv + (m * np + p) * 16);
      for (int n = 0; n < RN; ++n) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[n], xv);
        acc[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[n], dxm),
                                    acc[n][m]);
      }
    }
  }
  if ((nb - b0) & 1) {   // the last block alone, in the lower half
    const int64_t b = nb - 1;
    for (int n = 0; n < RN; ++n) {
      __m256i wv;
      if constexpr (F == Fmt::Q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * q_row +
                                                                              b * 16));
        wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                              _mm256_set1_epi8(0x0F));
      } else {
        wv = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * q_row + b * kBlock)),
            _mm256_set1_epi8(static_cast<char>(0x80)));
      }
      const float dwn = _cvtsh_ss(d[n * nb + b]);
      for (int m = 0; m < RM; ++m) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq + m * K + b * kBlock));
        const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s),
                                       _mm256_set1_ps(dwn * x.dxn[(m0 + m) * x.sx_row + b]));
        acc[n][m] = _mm512_add_ps(acc[n][m], _mm512_zextps256_ps512(t));
      }
    }
  }
  // + sum_b min_b sx_b: Q4_1's mins, or Q8_0's -128 d
  const uint16_t* mins = F == Fmt::Q4 ? mn : d;
  const __m512 mscale = _mm512_set1_ps(F == Fmt::Q4 ? 1.f : -128.f);
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const __mmask16 mask = nb - b0 >= 16 ? 0xFFFF
                                         : static_cast<__mmask16>((1u << (nb - b0)) - 1);
    __m512 mv[RN];
    for (int n = 0; n < RN; ++n)
      mv[n] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + n * nb + b0)),
                            mscale);
    for (int m = 0; m < RM; ++m) {
      const __m512 sxm = _mm512_loadu_ps(x.sx.get() + (m0 + m) * x.sx_row + b0);
      for (int n = 0; n < RN; ++n) acc[n][m] = _mm512_fmadd_ps(mv[n], sxm, acc[n][m]);
    }
  }
  // The sums of the tile's vectors, four at a time (one 16-lane reduction each would cost
  // as much as a short row's products).
  __m512 all[RN * RM];
  for (int m = 0; m < RM; ++m)
    for (int n = 0; n < RN; ++n) all[m * RN + n] = acc[n][m];
  int i = 0;
  for (; i + 4 <= RN * RM; i += 4)
    _mm_storeu_ps(out + i, reduce4(all[i], all[i + 1], all[i + 2], all[i + 3]));
  for (; i < RN * RM; ++i) out[i] = _mm512_reduce_add_ps(all[i]);
}

struct VnniTile {
  using X = VnniX;
  template <Fmt F, int RN, int RM>
  static void run(const uint8_t* q, int64_t q_row, const uint16_t* d, const uint16_t* mn,
                  int64_t nb, const VnniX& x, int64_t m0, float* out) {
    tile_vnni<F, RN, RM>(q, q_row, d, mn, nb, x, m0, out);
  }
};

// groups: how many groups of 16 blocks lead each weight row in the packed layout (0: the
// blocks as GGUF stores them).
template <Fmt F>
void drive_vnni(const VnniX& x, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
                const float* bias, float* y, int64_t N, int part = 0, int parts = 0) {
  const int64_t M = x.M;
  // One row: 8 weight rows a tile (8 streams and sums in flight; 4 measured 5-15% slower in
  // q8); 2-3 rows: 4 weight rows a tile; more activation rows:
  // 2 x 6 (2 x 6 integer and 2 x 6 float sums fill the 32 vector registers). 4 x 4, 3 x 4,
  // 4 x 3 and 3 x 6 measured within noise of 2 x 6 (session 18).
  if (M == 1) drive<VnniTile, F, 8, 1>(x, q, d, mn, bias, y, N, part, parts);
  else if (M <= 3) drive<VnniTile, F, 4, 3>(x, q, d, mn, bias, y, N, part, parts);
  else drive<VnniTile, F, 2, 6>(x, q, d, mn, bias, y, N, part, parts);
}

template <Fmt F>
void run_vnni(const float* xf, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
              const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t groups) {
  drive_vnni<F>(quantize_vnni<F>(xf, M, K, groups), q, d, mn, bias, y, N);
}
#endif  // TL_VNNI

// Whether the widest compiled path serves calls (tests turn it off to check the AVX2 one).
#if defined(TL_AVX2)
// ---- AVX2 over the packed layout ---------------------------------------------------------
//
// blocks.pack_groups' 64-byte chunk is two 32-byte halves, each holding 4 codes of each of 8
// blocks, so the layout the VNNI kernel reads serves 8-lane AVX2 vectors too: maddubs
// (u8 x s8 -> pairs of s16) then madd with ones leave block i's 4 products of a chunk in
// int32 lane i, and a group's 8 chunks add up in place, so a block's whole sum ends in one
// lane and the scales multiply once per 8 blocks (the unpacked AVX2 row_dot converts and
// scales every block: about twice the instructions per weight, and a 2-core AVX2 machine
// is compute-bound there at batch 1).
// q4: a code is 0..15, a pair of products at most 2 * 15 * 127 = 3,810 in magnitude, so the
// 8 chunk products of a block (low and high nibbles of 4 loads) add up in int16 (30,480)
// before one madd. q8: codes are signed, so the sign moves onto the activation
// (sign(x, w) * |w|, as llama.cpp's AVX2 path); a pair of products reaches 2 * 128 * 127 =
// 32,512, so every chunk is widened to int32 by its own madd.
// The activations are quantized as quantize_rows does (same dx, same codes), the leading
// groups' codes interleaved as the weights are (code j of block i of a group at
// (j / 4) * 64 + i * 4 + j % 4), the tail blocks in natural order for row_dot.

// Weight rows ahead of a tile that it prefetches.
constexpr int kAvx2PrefetchRows = 8;

struct Avx2X {
  int64_t M, K, nb, groups;
  std::unique_ptr<int8_t[]> xq;   // [M, K]
  std::unique_ptr<float[]> dx;    // [M, nb]
  std::unique_ptr<float[]> sx;    // [M, nb]: dx * sum(xq)
};

// pair_tail (q4): the tail blocks after the groups in pairs, each pair's 64 codes as
// [lo(A) lo(B) hi(A) hi(B)] (16 each, as the VNNI path's), so that one 32-byte load of a
// pair's nibbles serves both blocks; a lone last block stays in natural order.
Avx2X alloc_avx2(int64_t M, int64_t K, int64_t groups) {
  Avx2X v;
  v.M = M; v.K = K; v.nb = K / kBlock; v.groups = groups;
  v.xq.reset(new int8_t[M * K]);
  v.dx.reset(new float[M * v.nb]);
  v.sx.reset(new float[M * v.nb]);
  return v;
}

// x's M rows into v (allocated by alloc_avx2 for them).
void quantize_avx2_into(Avx2X& v, const float* x, bool pair_tail) {
  const int64_t K = v.K, b0 = v.groups * 16;
  at::parallel_for(0, v.M * v.nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / v.nb, b = i % v.nb;
      const float* xb = x + i * kBlock;
      __m256 amax = _mm256_setzero_ps();
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (int j = 0; j < kBlock; j += 8)
        amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xb + j), abs_mask));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float a = _mm_cvtss_f32(h);
      const float inv = a > 0.f ? 127.f / a : 0.f;
      alignas(32) int32_t codes[kBlock];
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < kBlock; j += 8) {   // cvtps rounds to nearest even, as nearbyint
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j),
                                                           _mm256_set1_ps(inv)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + j), c);
        sum = _mm256_add_epi32(sum, c);
      }
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      int8_t* qr = v.xq.get() + m * K;
      if (b < b0) {
        int8_t* gp = qr + (b / 16) * 512 + (b % 16) * 4;
        for (int j = 0; j < kBlock; ++j) gp[(j / 4) * 64 + j % 4] = static_cast<int8_t>(codes[j]);
      } else if (pair_tail && (b - b0) / 2 < (v.nb - b0) / 2) {
        int8_t* pp = qr + (b0 + (b - b0) / 2 * 2) * kBlock + ((b - b0) % 2) * 16;
        for (int j = 0; j < kBlock; ++j)
          pp[(j < 16 ? 0 : 32) + j % 16] = static_cast<int8_t>(codes[j]);
      } else {
        for (int j = 0; j < kBlock; ++j) qr[b * kBlock + j] = static_cast<int8_t>(codes[j]);
      }
      const float dv = a / 127.f;
      v.dx[i] = dv;
      v.sx[i] = dv * static_cast<float>(_mm_cvtsi128_si32(s));
    }
  });
}

Avx2X quantize_avx2_packed(const float* x, int64_t M, int64_t K, int64_t groups,
                           bool pair_tail) {
  Avx2X v = alloc_avx2(M, K, groups);
  quantize_avx2_into(v, x, pair_tail);
  return v;
}

// out[m * RN + n] = weight row n . activation row m0 + m (without bias), RN rows of the
// packed weights (q_row bytes apart) against RM activation rows.
template <Fmt F, int RN, int RM>
inline void tile_avx2(const uint8_t* q, int64_t q_row, const uint16_t* d, const uint16_t* mn,
                      int64_t nb, const Avx2X& x, int64_t m0, float* out) {
  __m256 acc[RN][RM];
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc[n][m] = _mm256_setzero_ps();
  const int64_t K = x.K, groups = x.groups;
  const int8_t* xq = x.xq.get() + m0 * K;
  const float* dx = x.dx.get() + m0 * nb;
  const float* sx = x.sx.get() + m0 * nb;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int64_t group_bytes = F == Fmt::Q4 ? 256 : 512;
  const uint8_t* ahead = q + kAvx2PrefetchRows * q_row;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t l = 0; l < RN * group_bytes / 64; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + g * RN * group_bytes + l * 64),
                   _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {   // blocks 0-7 of the group, then 8-15
      __m256i isum[RN][RM];
      for (int n = 0; n < RN; ++n)
        for (int m = 0; m < RM; ++m) isum[n][m] = _mm256_setzero_si256();
      if constexpr (F == Fmt::Q4) {
        for (int c = 0; c < 4; ++c) {   // low nibbles: codes 4c.., high: codes 16 + 4c..
          __m256i xl[RM], xh[RM];
          for (int m = 0; m < RM; ++m) {
            const int8_t* xp = xq + m * K + g * 512 + half * 32;
            xl[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + c * 64));
            xh[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + (c + 4) * 64));
          }
          for (int n = 0; n < RN; ++n) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                q + n * q_row + g * group_bytes + c * 64 + half * 32));
            const __m256i lo = _mm256_and_si256(raw, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int m = 0; m < RM; ++m)
              isum[n][m] = _mm256_add_epi16(
                  isum[n][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[m]),
                                               _mm256_maddubs_epi16(hi, xh[m])));
          }
        }
        for (int n = 0; n < RN; ++n)
          for (int m = 0; m < RM; ++m) isum[n][m] = _mm256_madd_epi16(isum[n][m], ones);
      } else {
        for (int c = 0; c < 8; ++c) {
          __m256i xv[RM];
          for (int m = 0; m < RM; ++m)
            xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                xq + m * K + g * 512 + c * 64 + half * 32));
          for (int n = 0; n < RN; ++n) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                q + n * q_row + g * group_bytes + c * 64 + half * 32));
            const __m256i aw = _mm256_sign_epi8(w, w);
            for (int m = 0; m < RM; ++m)
              isum[n][m] = _mm256_add_epi32(
                  isum[n][m], _mm256_madd_epi16(
                                  _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[m], w)), ones));
          }
        }
      }
      const int64_t bb = g * 16 + half * 8;   // the half's first block
      for (int n = 0; n < RN; ++n) {
        const __m256 dw = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + n * nb + bb)));
        for (int m = 0; m < RM; ++m)
          acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[n][m]),
                                      _mm256_mul_ps(dw, _mm256_loadu_ps(dx + m * nb + bb)),
                                      acc[n][m]);
      }
      if constexpr (F == Fmt::Q4) {   // + m_w dx sum(xq), per block
        for (int n = 0; n < RN; ++n) {
          const __m256 mv = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + n * nb + bb)));
          for (int m = 0; m < RM; ++m)
            acc[n][m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx + m * nb + bb), acc[n][m]);
        }
      }
    }
  }
  // The tail blocks after the groups (the default model's 576 columns: one group and a
  // pair) go into the same sums: a q4 pair's 32 bytes are one vector (block A's nibbles in
  // the low half, B's in the high half, against the pair's activation codes laid out to
  // match), each q8 block one vector. Before, each weight row's tail was a call of the
  // unpacked row_dot with its own horizontal sum: 2 blocks of 18 cost as much as 10
  // packed ones (3,072 x 576 q4 at one row on one core: 79 us against 57 us for 512
  // columns).
  const int64_t b0 = groups * 16;
  const int64_t tail_off = groups * group_bytes;
  int64_t b = b0;
  if constexpr (F == Fmt::Q4) {
    const __m256i pair_lanes = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    for (; b + 2 <= nb; b += 2) {
      for (int n = 0; n < RN; ++n) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            q + n * q_row + tail_off + (b - b0) * 16));
        const __m256i lo = _mm256_and_si256(raw, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        uint32_t two;
        std::memcpy(&two, d + n * nb + b, 4);
        const __m256 dw = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)))),
            pair_lanes);
        for (int m = 0; m < RM; ++m) {
          const int8_t* xp = xq + m * K + b * kBlock;
          const __m256i p = _mm256_madd_epi16(
              _mm256_add_epi16(
                  _mm256_maddubs_epi16(lo, _mm256_loadu_si256(
                                               reinterpret_cast<const __m256i*>(xp))),
                  _mm256_maddubs_epi16(hi, _mm256_loadu_si256(
                                               reinterpret_cast<const __m256i*>(xp + 32)))),
              ones);
          const __m256 dxm = _mm256_set_m128(_mm_set1_ps(dx[m * nb + b + 1]),
                                             _mm_set1_ps(dx[m * nb + b]));
          acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, dxm),
                                      acc[n][m]);
        }
      }
    }
  }
  for (; b < nb; ++b) {   // q8's tail; q4's lone last block (natural order)
    for (int n = 0; n < RN; ++n) {
      __m256i w, sign;
      if constexpr (F == Fmt::Q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
            q + n * q_row + tail_off + (b - b0) * 16));
        w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      } else {
        sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            q + n * q_row + tail_off + (b - b0) * kBlock));
        w = _mm256_sign_epi8(sign, sign);
      }
      const float dw = _cvtsh_ss(d[n * nb + b]);
      for (int m = 0; m < RM; ++m) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K +
                                                                         b * kBlock));
        if constexpr (F == Fmt::Q8) xv = _mm256_sign_epi8(xv, sign);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
        acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * dx[m * nb + b]),
                                    acc[n][m]);
      }
    }
  }
  // The tile's sums, four vectors a reduction.
  __m256 all[RN * RM];
  for (int m = 0; m < RM; ++m)
    for (int n = 0; n < RN; ++n) all[m * RN + n] = acc[n][m];
  int i = 0;
  for (; i + 4 <= RN * RM; i += 4)
    _mm_storeu_ps(out + i, hsum4(all[i], all[i + 1], all[i + 2], all[i + 3]));
  for (; i < RN * RM; ++i) out[i] = hsum(all[i]);
  if constexpr (F == Fmt::Q4) {   // + m_w dx sum(xq) of the tail blocks
    for (int n = 0; n < RN; ++n)
      for (int m = 0; m < RM; ++m) {
        float t = 0.f;
        for (int64_t bt = b0; bt < nb; ++bt) t += _cvtsh_ss(mn[n * nb + bt]) * sx[m * nb + bt];
        out[m * RN + n] += t;
      }
  }
}

struct Avx2Tile {
  using X = Avx2X;
  template <Fmt F, int RN, int RM>
  static void run(const uint8_t* q, int64_t q_row, const uint16_t* d, const uint16_t* mn,
                  int64_t nb, const Avx2X& x, int64_t m0, float* out) {
    static_assert(RM <= 4, "the AVX2 tile: up to 4 activation rows");
    tile_avx2<F, RN, RM>(q, q_row, d, mn, nb, x, m0, out);
  }
};

template <Fmt F>
void drive_avx2_packed(const Avx2X& x, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
                       const float* bias, float* y, int64_t N, int part = 0, int parts = 0) {
  const int64_t M = x.M;
  if constexpr (F == Fmt::Q8) {   // one weight row a tile
    if (M == 1) drive<Avx2Tile, F, 1, 1>(x, q, d, mn, bias, y, N, part, parts);
    else drive<Avx2Tile, F, 1, 4>(x, q, d, mn, bias, y, N, part, parts);
  } else {
    // One row: 2 weight rows a tile. 4 spilled (8 activation vectors of a group's codes
    // stay live beside the sums; perf annotate showed the stack traffic): 3,072 x 576 on
    // one core in cache 74-78 -> 70-71 us, 30 layers from memory 3.54-3.79 -> 3.41-3.58 ms
    // (alternating processes, session 24).
    if (M == 1) drive<Avx2Tile, F, 2, 1>(x, q, d, mn, bias, y, N, part, parts);
    else if (M == 2) drive<Avx2Tile, F, 2, 2>(x, q, d, mn, bias, y, N, part, parts);
    else drive<Avx2Tile, F, 1, 4>(x, q, d, mn, bias, y, N, part, parts);
  }
}

template <Fmt F>
void run_avx2_packed(const float* xf, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
                     const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  drive_avx2_packed<F>(quantize_avx2_packed(xf, M, K, K / kBlock / 16, F == Fmt::Q4), q, d, mn,
                       bias, y, N);
}
#endif  // TL_AVX2

bool g_use_widest = true;

template <Fmt F>
void run(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
         const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
#if defined(TL_VNNI)
  if (g_use_widest) return run_vnni<F>(x, q, d, mn, bias, y, M, N, K, 0);
#endif
  const int64_t nb = K / kBlock;
  const int64_t q_row = F == Fmt::Q4 ? K / 2 : K;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  quantize_rows(x, M, K, xq.data(), dx.data(), sx.data());
  // ~32 weight rows per task: enough to balance two to a few dozen threads.
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    float out[kMRows];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* qn = q + n * q_row;
      const uint16_t* dn = d + n * nb;
      const uint16_t* mnn = mn ? mn + n * nb : nullptr;
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += kMRows) {
        const int64_t ms = std::min<int64_t>(kMRows, M - m0);
        dispatch<F>(ms, qn, dn, mnn, xq.data() + m0 * K, dx.data() + m0 * nb,
                    sx.data() + m0 * nb, K, nb, out);
        for (int64_t m = 0; m < ms; ++m) y[(m0 + m) * N + n] = out[m] + b;
      }
    }
  });
}

void check_blocks(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                  int64_t q_row_bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && d.dim() == 2, "block_gemm: 2-D tensors");
  TORCH_CHECK(x.size(1) % kBlock == 0, "block_gemm: K must be a multiple of 32");
  const int64_t nb = x.size(1) / kBlock;
  TORCH_CHECK(q.size(1) == nb * q_row_bytes_per_block && d.size(0) == q.size(0) &&
                  d.size(1) == nb,
              "block_gemm: weight blocks do not match x's width");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous(), "block_gemm: contiguous blocks");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16, "block_gemm: scales must be float16");
}

torch::Tensor finish(const torch::Tensor& x, torch::Tensor y) {
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

#if defined(TL_AVX2)
// The packed operators' work for the decode stack's team (team.h): the activations
// quantized once into buffers kept for the step, the tiles split by part, with the path
// and tile shapes the operator would take.
template <Fmt F>
class TeamBlockCall final : public tl_team::Projection {
 public:
  TeamBlockCall(int64_t M, int64_t K) {
    const int64_t groups = K / kBlock / 16;
#if defined(TL_VNNI)
    vnni_ = g_use_widest;
    if (vnni_) {
      vx_ = alloc_vnni(M, K, groups);
      return;
    }
#endif
    ax_ = alloc_avx2(M, K, groups);
  }
  void prepare(const void* xv) override {
    const float* x = static_cast<const float*>(xv);
#if defined(TL_VNNI)
    if (vnni_) return quantize_vnni_into<F>(vx_, x);
#endif
    quantize_avx2_into(ax_, x, F == Fmt::Q4);
  }
  void rows(const tl_team::Weights& w, void* yv, int part, int parts) const override {
    float* y = static_cast<float*>(yv);
    const auto* q = static_cast<const uint8_t*>(w.data);
    const auto* d = static_cast<const uint16_t*>(w.scales);
    const auto* mn = static_cast<const uint16_t*>(w.mins);
#if defined(TL_VNNI)
    if (vnni_) return drive_vnni<F>(vx_, q, d, mn, w.bias, y, w.n, part, parts);
#endif
    drive_avx2_packed<F>(ax_, q, d, mn, w.bias, y, w.n, part, parts);
  }

 private:
#if defined(TL_VNNI)
  bool vnni_ = false;
  VnniX vx_;
#endif
  Avx2X ax_;
};
#endif

// fp32 activations only (the q4 and q8 modes').
tl_team::Projection* make_team_block_call(int kind, int, int64_t M, int64_t K, bool bf16) {
#if defined(TL_AVX2)
  if (bf16 || M <= 0 || K % kBlock != 0) return nullptr;
  if (kind == tl_team::kQ4Packed) return new TeamBlockCall<Fmt::Q4>(M, K);
  if (kind == tl_team::kQ8Packed) return new TeamBlockCall<Fmt::Q8>(M, K);
#endif
  (void)kind; (void)M; (void)K; (void)bf16;
  return nullptr;
}

}  // namespace

// x: [M, K] fp32 or bf16; qs: [N, K/2] uint8; d, m: [N, K/32] fp16; bias: [N] or empty.
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                      torch::Tensor bias) {
  check_blocks(x, qs, d, 16);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8, "q4_gemm: nibbles must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == torch::kFloat16 && m.is_contiguous(),
              "q4_gemm: mins must match the scales");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  torch::Tensor bf = bias.numel() > 0 ? bias.to(torch::kFloat32).contiguous() : bias;
  if (M > 0 && N > 0)
    run<Fmt::Q4>(xf.data_ptr<float>(), qs.data_ptr<uint8_t>(),
                 reinterpret_cast<const uint16_t*>(d.data_ptr()),
                 reinterpret_cast<const uint16_t*>(m.data_ptr()),
                 bias.numel() > 0 ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K);
  return finish(x, y);
}

// x: [M, K] fp32 or bf16; qs: [N, K] int8; d: [N, K/32] fp16; bias: [N] or empty.
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor bias) {
  check_blocks(x, qs, d, kBlock);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_gemm: weights must be int8");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  torch::Tensor bf = bias.numel() > 0 ? bias.to(torch::kFloat32).contiguous() : bias;
  if (M > 0 && N > 0)
    run<Fmt::Q8>(xf.data_ptr<float>(), reinterpret_cast<const uint8_t*>(qs.data_ptr<int8_t>()),
                 reinterpret_cast<const uint16_t*>(d.data_ptr()), nullptr,
                 bias.numel() > 0 ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K);
  return finish(x, y);
}

// The same products over the packed layout (blocks.pack_groups): each row's leading groups
// of 16 blocks interleaved in 4-byte chunks, so that a block's sum stays in one lane and its
// scales multiply once per 16 blocks (8 on AVX2). The AVX-512 VNNI build serves them
// with tile_vnni, an AVX2 build with tile_avx2 (and a VNNI build too with the widest path
// turned off, for tests).
torch::Tensor q4_gemm_packed(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                             torch::Tensor bias) {
  check_blocks(x, qs, d, 16);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8, "q4_gemm_packed: nibbles must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == torch::kFloat16 && m.is_contiguous(),
              "q4_gemm_packed: mins must match the scales");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  torch::Tensor bf = bias.numel() > 0 ? bias.to(torch::kFloat32).contiguous() : bias;
  if (M > 0 && N > 0) {
#if defined(TL_VNNI)
    if (g_use_widest)
      run_vnni<Fmt::Q4>(xf.data_ptr<float>(), qs.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(d.data_ptr()),
                        reinterpret_cast<const uint16_t*>(m.data_ptr()),
                        bias.numel() > 0 ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M,
                        N, K, K / kBlock / 16);
    else
#endif
#if defined(TL_AVX2)
    run_avx2_packed<Fmt::Q4>(xf.data_ptr<float>(), qs.data_ptr<uint8_t>(),
                             reinterpret_cast<const uint16_t*>(d.data_ptr()),
                             reinterpret_cast<const uint16_t*>(m.data_ptr()),
                             bias.numel() > 0 ? bf.data_ptr<float>() : nullptr,
                             y.data_ptr<float>(), M, N, K);
#else
    TORCH_CHECK(false, "q4_gemm_packed: built without AVX2");
#endif
  }
  return finish(x, y);
}

torch::Tensor q8_gemm_packed(torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                             torch::Tensor bias) {
  check_blocks(x, qs, d, kBlock);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_gemm_packed: weights must be int8");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  torch::Tensor bf = bias.numel() > 0 ? bias.to(torch::kFloat32).contiguous() : bias;
  if (M > 0 && N > 0) {
#if defined(TL_VNNI)
    if (g_use_widest)
      run_vnni<Fmt::Q8>(xf.data_ptr<float>(),
                        reinterpret_cast<const uint8_t*>(qs.data_ptr<int8_t>()),
                        reinterpret_cast<const uint16_t*>(d.data_ptr()), nullptr,
                        bias.numel() > 0 ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M,
                        N, K, K / kBlock / 16);
    else
#endif
#if defined(TL_AVX2)
    run_avx2_packed<Fmt::Q8>(xf.data_ptr<float>(),
                             reinterpret_cast<const uint8_t*>(qs.data_ptr<int8_t>()),
                             reinterpret_cast<const uint16_t*>(d.data_ptr()), nullptr,
                             bias.numel() > 0 ? bf.data_ptr<float>() : nullptr,
                             y.data_ptr<float>(), M, N, K);
#else
    TORCH_CHECK(false, "q8_gemm_packed: built without AVX2");
#endif
  }
  return finish(x, y);
}

bool packed_built() {
#if defined(TL_AVX2)
  return true;
#else
  return false;
#endif
}

std::string simd_path() {
#if defined(TL_VNNI)
  if (g_use_widest) return "avx512-vnni";
#endif
#if defined(TL_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// As dispatcher operators too, so a compiled decode program can call them.
TORCH_LIBRARY_FRAGMENT(tokenloom, lib) {
  lib.def("q4_gemm(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor bias) -> Tensor");
  lib.def("q8_gemm(Tensor x, Tensor qs, Tensor d, Tensor bias) -> Tensor");
  lib.def("q4_gemm_packed(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor bias) -> Tensor");
  lib.def("q8_gemm_packed(Tensor x, Tensor qs, Tensor d, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, lib) {
  lib.impl("q4_gemm", &q4_gemm);
  lib.impl("q8_gemm", &q8_gemm);
  lib.impl("q4_gemm_packed", &q4_gemm_packed);
  lib.impl("q8_gemm_packed", &q8_gemm_packed);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_gemm", &q4_gemm, "x . W^T with W in GGUF Q4_1-style 32-weight blocks");
  mod.def("q8_gemm", &q8_gemm, "x . W^T with W in GGUF Q8_0-style 32-weight blocks");
  mod.def("q4_gemm_packed", &q4_gemm_packed, "q4_gemm over blocks.pack_groups' layout");
  mod.def("q8_gemm_packed", &q8_gemm_packed, "q8_gemm over blocks.pack_groups' layout");
  mod.def("packed_built", &packed_built, "whether the packed-layout kernels were compiled");
  mod.def("simd_path", &simd_path, "which SIMD path serves calls");
  mod.def("team_factory", []() {
    return pybind11::capsule(reinterpret_cast<void*>(&make_team_block_call),
                             tl_team::kBlockCapsule);
  }, "the packed kernels for the decode stack's one OpenMP team per step (team.h)");
  mod.def("use_widest_path", [](bool on) { g_use_widest = on; },
          "false: serve calls with the next narrower path (for tests)");
}
