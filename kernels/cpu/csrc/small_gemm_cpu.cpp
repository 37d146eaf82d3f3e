// Decode-sized matmuls on the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias), for the few rows
// of a decode batch, with W stored as fp32, bf16 or int8 (per-row scales).
//
// A decode step is bound by streaming the weights once from memory. This kernel walks W
// exactly once per call, split across threads, one row (small_gemm) or a 4-row strip
// (small_gemm_strips) at a time, and multiplies it by every row of x while it is in L1:
// bytes read = W's bytes, whatever M.
// Weights are widened to fp32 in registers (bf16: a 16-bit shift; int8: sign-extend +
// convert, the row's scale applied once to the finished dot product), products are summed
// in fp32, so fp32 activations stay fp32 whatever the weight storage.
//
// AVX-512 or AVX2+FMA paths when the compiler targets them (-march=native); otherwise plain
// loops the compiler vectorises for what the machine has. Which kernel a
// model uses is measured at start-up (kernels/cpu/linear.py), never assumed.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "team.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TL_AVX2 1
#endif

namespace {

constexpr int64_t kStrip = 4;   // weight rows per inner block (at most)
constexpr int64_t kMRows = 4;   // activation rows per inner block (4 x 4 accumulators)

// BF16_DOT: bf16 weights times bf16 activations on vdpbf16ps (x stays bf16; only where the
// compiler targets AVX512-BF16).
enum class WType { F32, BF16, I8, BF16_DOT };

// The x element a kernel reads: bf16 bits for BF16_DOT, fp32 otherwise.
template <WType WT>
using XType = std::conditional_t<WT == WType::BF16_DOT, uint16_t, float>;


#ifdef TL_AVX512
template <WType WT>
inline __m512 load_w(const void* w, int64_t k, __mmask16 m) {
  if constexpr (WT == WType::F32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(w) + k);
  } else if constexpr (WT == WType::BF16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(w) + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    __m128i b = _mm_maskz_loadu_epi8(m, static_cast<const int8_t*>(w) + k);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

// acc[r][m] = sum_k W[r, k] * x[m, k] for R weight rows and MS x rows, all compile-time so
// that the R x MS accumulators stay in registers. One accumulator per (r, m), although its
// FMA chain bounds the loop with the weights in cache: 4 independent sums over k ran a
// batch-1 GEMV 1.8x faster from cache but 10-25% slower from DRAM (Zen 4, bf16 and fp32,
// measured side by side), and a decode step reads its weights from DRAM.
template <WType WT, int R, int MS>
inline void strip_dot(const char* w, int64_t w_row_bytes, const float* x, int64_t K,
                      float acc[kStrip][kMRows]) {
  __m512 a[R][MS];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MS; ++m) a[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MS];
    for (int m = 0; m < MS; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load_w<WT>(w + r * w_row_bytes, k, (__mmask16)0xFFFF);
      for (int m = 0; m < MS; ++m) a[r][m] = _mm512_fmadd_ps(wv, xv[m], a[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    __m512 xv[MS];
    for (int m = 0; m < MS; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load_w<WT>(w + r * w_row_bytes, k, mask);
      for (int m = 0; m < MS; ++m) a[r][m] = _mm512_fmadd_ps(wv, xv[m], a[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MS; ++m) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
}
#if defined(__AVX512BF16__)
#define TL_BF16_DOT 1
// bf16 weights times bf16 activations on vdpbf16ps: 32 products a step, two summed into
// each fp32 lane, the products exact (a bf16 times a bf16 fits an fp32). A quarter of the
// instructions of widening both to fp32 (load, widen, shift, FMA per 16 weights), which
// left the loop, not the memory, pacing steps of 2 to 16 rows: the default model's
// projections, side by side on a Zen 4, 1.25x (2 rows) to 2x (16 rows) faster, about even
// at 1 row. Only where the activations are bf16 already (bf16 mode), so nothing is rounded
// that the widening path keeps. vdpbf16ps flushes subnormal inputs and outputs to zero.
template <int R, int MS>
inline void strip_dot_bf16(const char* w, int64_t w_row_bytes, const uint16_t* x, int64_t K,
                           float acc[kStrip][kMRows]) {
  __m512 a[R][MS];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MS; ++m) a[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask =
        K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
    __m512bh xv[MS];
    for (int m = 0; m < MS; ++m)
      xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(
          mask, reinterpret_cast<const uint16_t*>(w + r * w_row_bytes) + k);
      for (int m = 0; m < MS; ++m) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MS; ++m) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
}
#endif
#elif defined(TL_AVX2)
template <WType WT>
inline __m256 load_w8(const void* w, int64_t k) {
  if constexpr (WT == WType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + k);
  } else if constexpr (WT == WType::BF16) {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i b = _mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

template <WType WT>
inline float w_at(const void* w, int64_t k) {
  if constexpr (WT == WType::F32) {
    return static_cast<const float*>(w)[k];
  } else if constexpr (WT == WType::BF16) {
    uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[k]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<float>(static_cast<const int8_t*>(w)[k]);
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// As the AVX-512 path with 8 lanes: R x MS accumulators in registers (4 x 3 + 3 x-vectors
// + 1 weight vector = the 16 ymm registers; 4 x 4 spills a few, still one pass over W),
// each U times over interleaved stretches of k (see strip_dot).
template <WType WT, int R, int MS, int U>
inline void strip_dot_u(const char* w, int64_t w_row_bytes, const float* x, int64_t K,
                        float acc[kStrip][kMRows]) {
  __m256 a[U][R][MS];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MS; ++m) a[u][r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      __m256 xv[MS];
      for (int m = 0; m < MS; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k + 8 * u);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = load_w8<WT>(w + r * w_row_bytes, k + 8 * u);
        for (int m = 0; m < MS; ++m) a[u][r][m] = _mm256_fmadd_ps(wv, xv[m], a[u][r][m]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MS];
    for (int m = 0; m < MS; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load_w8<WT>(w + r * w_row_bytes, k);
      for (int m = 0; m < MS; ++m) a[0][r][m] = _mm256_fmadd_ps(wv, xv[m], a[0][r][m]);
    }
  }
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MS; ++m) a[0][r][m] = _mm256_add_ps(a[0][r][m], a[u][r][m]);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MS; ++m) {
      float s = hsum8(a[0][r][m]);
      for (int64_t j = k; j < K; ++j) s += w_at<WT>(w + r * w_row_bytes, j) * x[m * K + j];
      acc[r][m] = s;
    }
}
// With fewer than 4 (r, m) pairs, narrow weights (int8, bf16) get U independent sums per
// pair over k: one FMA chain (8 lanes, a 4-5 cycle latency) caps a core at ~2 weights a
// cycle, which an int8 row reaches before the memory does. Interleaved on a 2-core AVX2
// Zen 3, 30 layers of the default model's projections: int8 1.48x (1 row), 1.36x (2),
// 1.26x (3); bf16 1.07-1.11x; fp32 0.96-1.07x (its 4 bytes a weight are the bound: one
// chain kept, as on AVX-512 above).
template <WType WT, int R, int MS>
inline void strip_dot(const char* w, int64_t w_row_bytes, const float* x, int64_t K,
                      float acc[kStrip][kMRows]) {
  constexpr int U = WT == WType::F32 || R * MS >= 4 ? 1 : (R * MS >= 2 ? 2 : 4);
  strip_dot_u<WT, R, MS, U>(w, w_row_bytes, x, K, acc);
}
#else
template <WType WT>
inline float w_at(const void* w, int64_t k) {
  if constexpr (WT == WType::F32) {
    return static_cast<const float*>(w)[k];
  } else if constexpr (WT == WType::BF16) {
    uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[k]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<float>(static_cast<const int8_t*>(w)[k]);
  }
}

template <WType WT, int R, int MS>
inline void strip_dot(const char* w, int64_t w_row_bytes, const float* x, int64_t K,
                      float acc[kStrip][kMRows]) {
  for (int r = 0; r < R; ++r) {
    const void* wr = w + r * w_row_bytes;
    for (int m = 0; m < MS; ++m) {
      const float* xm = x + m * K;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += w_at<WT>(wr, k) * xm[k];
      acc[r][m] = s;
    }
  }
}
#endif

template <WType WT, int R, int MS>
inline void dot(const char* w, int64_t wb, const XType<WT>* x, int64_t K,
                float acc[kStrip][kMRows]) {
#ifdef TL_BF16_DOT
  if constexpr (WT == WType::BF16_DOT) {
    strip_dot_bf16<R, MS>(w, wb, x, K, acc);
    return;
  } else
#endif
  {
    static_assert(WT != WType::BF16_DOT, "BF16_DOT needs an AVX512-BF16 build");
    strip_dot<WT, R, MS>(w, wb, x, K, acc);
  }
}

template <WType WT, int R>
inline void dispatch_ms(int64_t ms, const char* w, int64_t wb, const XType<WT>* x, int64_t K,
                        float acc[kStrip][kMRows]) {
  switch (ms) {
    case 1: dot<WT, R, 1>(w, wb, x, K, acc); break;
    case 2: dot<WT, R, 2>(w, wb, x, K, acc); break;
    case 3: dot<WT, R, 3>(w, wb, x, K, acc); break;
    default: dot<WT, R, 4>(w, wb, x, K, acc); break;
  }
}

template <WType WT>
inline void dispatch(int rows, int64_t ms, const char* w, int64_t wb, const XType<WT>* x,
                     int64_t K, float acc[kStrip][kMRows]) {
  if (rows == kStrip) {
    dispatch_ms<WT, kStrip>(ms, w, wb, x, K, acc);
  } else {  // the last strip of a matrix whose row count is not a multiple of kStrip
    for (int r = 0; r < rows; ++r) {
      float one[kStrip][kMRows];
      dispatch_ms<WT, 1>(ms, w + r * wb, wb, x, K, one);
      for (int m = 0; m < ms; ++m) acc[r][m] = one[0][m];
    }
  }
}

// strip: weight rows walked together (1 or kStrip). With 1 the weights are read front to
// back as one stream per thread; with kStrip, kStrip rows are read side by side, sharing
// each load of x. Which is faster depends on the machine (an AMD Zen 4 streamed DRAM 1.3x
// (fp32) to 1.6x (bf16) faster one row at a time; x is in L1 either way), so both are
// kernels the planner measures: small_gemm (rows) and small_gemm_strips.
// y: fp32, or bf16 (rounded to nearest even as it is stored: what a separate .to(bf16) pass
// over an fp32 result would give, without that pass and its allocation).
//
// One weight row at a time with every activation row of the call (M <= kMRows) has its own
// loop: each thread's rows go straight from one dot to the next. The general loop below
// (strips, then activation rows in fours, through two runtime switches a row) streamed the
// default model's fp32 projections at 0.70-0.75x the rate of this one when the machine
// read 55-60 GB/s (a Zen 4; ~0.95x at 33 GB/s): the weights come from DRAM, and a
// row of 576 fp32 weights lasts ~80 ns a thread, so a few dozen instructions between rows
// are not free.
// Rows [begin, end) of y. Not inlined: the operator's threads and the decode stack's team
// (team.h) run this one compiled body, so that their results are bit-identical (-ffast-math
// lets two inlined copies order a sum differently).
template <WType WT, int MS, typename YT>
__attribute__((noinline)) void rows_range(const XType<WT>* x, const char* w, const float* scale,
                                          const float* bias, YT* y, int64_t N, int64_t K,
                                          int64_t w_row_bytes, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    float acc[kStrip][kMRows];
    dot<WT, 1, MS>(w + n * w_row_bytes, w_row_bytes, x, K, acc);
    const float sc = scale ? scale[n] : 1.f;
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < MS; ++m) y[m * N + n] = YT(acc[0][m] * sc + b);
  }
}

// parts == 0: at::parallel_for over the rows; else share `part` of `parts` on this thread
// (the decode stack's one OpenMP team per step, team.h).
template <WType WT, int MS, typename YT>
void rows_one_at_a_time(const XType<WT>* x, const char* w, const float* scale,
                        const float* bias, YT* y, int64_t N, int64_t K, int64_t w_row_bytes,
                        int part, int parts) {
  auto go = [&](int64_t begin, int64_t end) {
    rows_range<WT, MS, YT>(x, w, scale, bias, y, N, K, w_row_bytes, begin, end);
  };
  if (parts == 0) at::parallel_for(0, N, 64, go);
  else go(N * part / parts, N * (part + 1) / parts);
}

// Strips [begin, end) of y (kept out of line as rows_range).
template <WType WT, typename YT>
__attribute__((noinline)) void strips_range(const XType<WT>* x, const char* w,
                                            const float* scale, const float* bias, YT* y,
                                            int64_t M, int64_t N, int64_t K,
                                            int64_t w_row_bytes, int64_t strip, int64_t begin,
                                            int64_t end) {
  float acc[kStrip][kMRows];
  for (int64_t s = begin; s < end; ++s) {
    const int64_t n0 = s * strip;
    const int rows = static_cast<int>(std::min<int64_t>(strip, N - n0));
    const char* ws = w + n0 * w_row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kMRows) {
      const int64_t ms = std::min<int64_t>(kMRows, M - m0);
      dispatch<WT>(rows, ms, ws, w_row_bytes, x + m0 * K, K, acc);
      for (int r = 0; r < rows; ++r) {
        const float sc = scale ? scale[n0 + r] : 1.f;
        const float b = bias ? bias[n0 + r] : 0.f;
        for (int m = 0; m < ms; ++m) y[(m0 + m) * N + n0 + r] = YT(acc[r][m] * sc + b);
      }
    }
  }
}

template <WType WT, typename YT>
void run(const XType<WT>* x, const char* w, const float* scale, const float* bias, YT* y,
         int64_t M, int64_t N, int64_t K, int64_t w_elem, int64_t strip, int part = 0,
         int parts = 0) {
  const int64_t w_row_bytes = K * w_elem;
  if (strip == 1 && M <= kMRows) {
    switch (M) {
      case 1:
        return rows_one_at_a_time<WT, 1, YT>(x, w, scale, bias, y, N, K, w_row_bytes, part,
                                             parts);
      case 2:
        return rows_one_at_a_time<WT, 2, YT>(x, w, scale, bias, y, N, K, w_row_bytes, part,
                                             parts);
      case 3:
        return rows_one_at_a_time<WT, 3, YT>(x, w, scale, bias, y, N, K, w_row_bytes, part,
                                             parts);
      default:
        return rows_one_at_a_time<WT, 4, YT>(x, w, scale, bias, y, N, K, w_row_bytes, part,
                                             parts);
    }
  }
  const int64_t strips = (N + strip - 1) / strip;
  auto go = [&](int64_t begin, int64_t end) {
    strips_range<WT, YT>(x, w, scale, bias, y, M, N, K, w_row_bytes, strip, begin, end);
  };
  // ~64 weight rows per task: enough to balance two to a few dozen threads.
  if (parts == 0) at::parallel_for(0, strips, 64 / strip, go);
  else go(strips * part / parts, strips * (part + 1) / parts);
}

// small_gemm / small_gemm_strips for the decode stack's team (team.h): the rows (strip 1)
// or strips (kStrip) loop the operator runs for this weight element, split by part. Y: the
// result's element (float, or c10::BFloat16 for bf16 activations, which are widened to
// fp32 once, as the operator does).
template <typename Y>
class TeamSmall final : public tl_team::Projection {
 public:
  TeamSmall(int elem, int64_t M, int64_t K, int64_t strip)
      : elem_(elem), M_(M), K_(K), strip_(strip) {
    if constexpr (!std::is_same_v<Y, float>) xf_.resize(M * K);
  }
  void prepare(const void* x) override {
    if constexpr (std::is_same_v<Y, float>) {
      x_ = static_cast<const float*>(x);
    } else {
      const auto* xb = static_cast<const c10::BFloat16*>(x);
      for (int64_t i = 0; i < M_ * K_; ++i) xf_[i] = static_cast<float>(xb[i]);
      x_ = xf_.data();
    }
  }
  void rows(const tl_team::Weights& w, void* yv, int part, int parts) const override {
    const char* wp = static_cast<const char*>(w.data);
    const float* sp = static_cast<const float*>(w.scales);
    Y* y = static_cast<Y*>(yv);
    switch (elem_) {
      case tl_team::kElemF32:
        return run<WType::F32, Y>(x_, wp, sp, w.bias, y, M_, w.n, K_, 4, strip_, part, parts);
      case tl_team::kElemBf16:
        return run<WType::BF16, Y>(x_, wp, sp, w.bias, y, M_, w.n, K_, 2, strip_, part, parts);
      default:
        return run<WType::I8, Y>(x_, wp, sp, w.bias, y, M_, w.n, K_, 1, strip_, part, parts);
    }
  }

 private:
  int elem_;
  int64_t M_, K_, strip_;
  std::vector<float> xf_;
  const float* x_ = nullptr;
};

tl_team::Projection* make_team_projection(int kind, int elem, int64_t M, int64_t K,
                                          bool bf16) {
  if (M <= 0 || K <= 0 || elem < tl_team::kElemF32 || elem > tl_team::kElemInt8) return nullptr;
  if (kind != tl_team::kSmallRows && kind != tl_team::kSmallStrips) return nullptr;
#ifdef TL_BF16_DOT
  // bf16 x bf16 takes vdpbf16ps on bf16 x there: not this loop.
  if (bf16 && elem == tl_team::kElemBf16) return nullptr;
#endif
  const int64_t strip = kind == tl_team::kSmallRows ? 1 : kStrip;
  if (bf16) return new TeamSmall<c10::BFloat16>(elem, M, K, strip);
  return new TeamSmall<float>(elem, M, K, strip);
}

// x: [M, K] fp32 or bf16; w: [N, K] fp32, bf16 or int8 (contiguous); scale: [N] fp32 (int8
// only, else empty); bias: [N] or empty. Returns [M, N] in x's dtype (sums in fp32).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                   const torch::Tensor& bias, int64_t strip) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: shapes");
  TORCH_CHECK(w.is_contiguous(), "small_gemm: weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
#ifdef TL_BF16_DOT
  const bool bf16_dot = w.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kBFloat16;
#else
  const bool bf16_dot = false;
#endif
  // The dot path reads x as it is (bf16); the others widen it to fp32 once per call.
  auto xf = bf16_dot ? x.contiguous() : x.to(torch::kFloat32).contiguous();
  const bool bf16_out = x.scalar_type() == torch::kBFloat16;
  auto y = torch::empty({M, N}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  const bool has_scale = scale.numel() > 0, has_bias = bias.numel() > 0;
  torch::Tensor sf = has_scale ? scale.to(torch::kFloat32).contiguous() : scale;
  torch::Tensor bf = has_bias ? bias.to(torch::kFloat32).contiguous() : bias;
  const float* sp = has_scale ? sf.data_ptr<float>() : nullptr;
  const float* bp = has_bias ? bf.data_ptr<float>() : nullptr;
  const char* wp = static_cast<const char*>(w.data_ptr());
  auto call = [&](auto* yp) {
    using YT = std::remove_pointer_t<decltype(yp)>;
    switch (w.scalar_type()) {
      case torch::kFloat32:
        run<WType::F32, YT>(xf.data_ptr<float>(), wp, sp, bp, yp, M, N, K, 4, strip);
        break;
      case torch::kBFloat16:
#ifdef TL_BF16_DOT
        if (bf16_dot) {
          run<WType::BF16_DOT, YT>(reinterpret_cast<const uint16_t*>(xf.data_ptr()), wp, sp, bp,
                                   yp, M, N, K, 2, strip);
          break;
        }
#endif
        run<WType::BF16, YT>(xf.data_ptr<float>(), wp, sp, bp, yp, M, N, K, 2, strip);
        break;
      case torch::kInt8:
        TORCH_CHECK(has_scale, "small_gemm: int8 weights need per-row scales");
        run<WType::I8, YT>(xf.data_ptr<float>(), wp, sp, bp, yp, M, N, K, 1, strip);
        break;
      default:
        TORCH_CHECK(false, "small_gemm: weight dtype must be float32, bfloat16 or int8");
    }
  };
  if (M > 0 && N > 0) {
    if (bf16_out) {
      call(y.data_ptr<c10::BFloat16>());
    } else {
      call(y.data_ptr<float>());
    }
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

}  // namespace

torch::Tensor small_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                         torch::Tensor bias) {
  return gemm(x, w, scale, bias, 1);
}

torch::Tensor small_gemm_strips(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                                torch::Tensor bias) {
  return gemm(x, w, scale, bias, kStrip);
}

bool avx512_build() {
#ifdef TL_AVX512
  return true;
#else
  return false;
#endif
}

bool bf16_dot_build() {
#ifdef TL_BF16_DOT
  return true;
#else
  return false;
#endif
}

std::string simd_path() {
#if defined(TL_AVX512)
  return "avx512";
#elif defined(TL_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// As a dispatcher operator too, so a compiled decode program can call it.
TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("small_gemm(Tensor x, Tensor w, Tensor scale, Tensor bias) -> Tensor");
  m.def("small_gemm_strips(Tensor x, Tensor w, Tensor scale, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("small_gemm", &small_gemm);
  m.impl("small_gemm_strips", &small_gemm_strips);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("team_factory", []() {
    return pybind11::capsule(reinterpret_cast<void*>(&make_team_projection),
                             tl_team::kSmallCapsule);
  }, "fp32 kernels for the decode stack's one OpenMP team per step (team.h)");
  m.def("small_gemm", &small_gemm, "decode-sized x . W^T with fp32/bf16/int8 weights");
  m.def("small_gemm_strips", &small_gemm_strips, "small_gemm, kStrip weight rows at a time");
  m.def("avx512_build", &avx512_build, "whether the AVX-512 path was compiled");
  m.def("simd_path", &simd_path, "which SIMD path was compiled");
  m.def("bf16_dot_build", &bf16_dot_build,
        "whether bf16 x bf16 runs on vdpbf16ps (AVX512-BF16 compiled)");
}
