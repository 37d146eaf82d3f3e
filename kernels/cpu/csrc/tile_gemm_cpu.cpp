// bf16 projections for mixed and prefill-sized steps on a CPU with AVX512-BF16:
// y[M, N] = x[M, K] . W[N, K]^T (+ bias), bf16 in and out, fp32 sums, on vdpbf16ps.
// fp32 x is accepted too (rounded to bf16, to nearest even, as it is packed; the result is
// then fp32, its sums not rounded): the q4/q8 models' dequantized bf16 copy
// (kernels/cpu/linear.py, "copy_tile_bf16") runs on it.
//
// oneDNN's bf16 matmul on prepacked weights ran the default model's 30 layers of
// projections at ~300 GFLOP/s for an 80-row step (16 decodes + a 64-token chunk: the step
// SLO chunking takes under load) against ~400 at 512 rows, on a 2-core AVX-512 machine:
// small chunks paid a quarter more per token in their matmuls. This kernel is the textbook
// register-tiled one, sized for such steps:
//
// - W is packed once, at load, into panels of 16 output columns: panel p is [K/2][16]
//   32-bit words, word (j, l) = the bf16 pair (W[16p + l, 2j], W[16p + l, 2j + 1]), which is
//   what vdpbf16ps multiplies lane-wise. N must be a multiple of 16 (every projection of
//   the models served here; linear.py offers the kernel only then).
// - x is packed per call into tiles of 8 rows: tile t is [K/2][8] words (row r's pair j),
//   rows past M zeros, so a tile's 8 broadcasts per k-pair read one 32-byte line.
// - The micro-kernel keeps 8 rows x kNV panels of fp32 sums in registers over the whole of
//   K: per k-pair, kNV panel loads, 8 broadcasts, 8 x kNV vdpbf16ps.
// - Threads split the panel groups; each walks every row tile over its group, so the
//   group's panels are read from memory once a call and from L2 after the first tile.
//
// Which kernel runs at which row count is measured at start-up (kernels/cpu/linear.py).
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define TL_TILE_GEMM 1
#else
#define TL_TILE_GEMM 0
#endif

namespace {

constexpr int64_t kMR = 8;    // rows per tile
constexpr int64_t kPW = 16;   // output columns per panel
constexpr int kNV = 3;        // panels per micro-kernel call

// [N, K] bf16 -> [N / 16, ceil(K / 2), 16] int32 (the panel layout above).
torch::Tensor tile_gemm_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(0) % kPW == 0,
              "tile_gemm_pack: a 2-d bf16 weight with a multiple of 16 rows");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = N / kPW, K2 = (K + 1) / 2;
  auto packed = torch::zeros({P, K2, kPW}, torch::kInt32);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* row = src + n * K;
    uint32_t* col = dst + (n / kPW) * K2 * kPW + n % kPW;
    for (int64_t j = 0; j < K2; ++j) {
      const uint32_t lo = row[2 * j], hi = 2 * j + 1 < K ? row[2 * j + 1] : 0;
      col[j * kPW] = lo | (hi << 16);
    }
  }
  return packed;
}

bool tile_gemm_built() { return TL_TILE_GEMM; }

#if TL_TILE_GEMM
static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// acc[r][c] = sum over k-pairs of x tile row r . panel c, for NV panels at `w` (K2 x 16
// words each, consecutive).
template <int NV>
static inline void micro(const uint32_t* a, const uint32_t* w, int64_t K2,
                         __m512 (&acc)[kMR][kNV]) {
  for (int r = 0; r < kMR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    __m512i wv[NV];
    for (int c = 0; c < NV; ++c) wv[c] = _mm512_loadu_si512(w + (c * K2 + j) * kPW);
    const uint32_t* aj = a + j * kMR;
    for (int r = 0; r < kMR; ++r) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(aj[r]));
      for (int c = 0; c < NV; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(xb), as_bh(wv[c]));
    }
  }
}

// Rows [m0, m0 + rows) x panels [p0, p0 + nv) of y from the sums (+ bias): rounded to bf16
// (Y = uint16_t), or as they are (Y = float).
template <typename Y>
static inline void store_tile(const __m512 (&acc)[kMR][kNV], int nv, int64_t rows, int64_t p0,
                              int64_t N, const float* bias, Y* y, int64_t m0) {
  for (int c = 0; c < nv; ++c) {
    const int64_t n0 = (p0 + c) * kPW;
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      if constexpr (std::is_same_v<Y, float>)
        _mm512_storeu_ps(y + (m0 + r) * N + n0, _mm512_add_ps(acc[r][c], b));
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * N + n0),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], b)));
    }
  }
}

// Row `row` of x as the bf16 pairs of its tile's words: bf16 as it is, fp32 rounded.
static inline uint32_t pair_word(const uint16_t* xb, const float* xf, int64_t row, int64_t K,
                                 int64_t j) {
  if (xb != nullptr) {
    const uint16_t lo = xb[row * K + 2 * j], hi = 2 * j + 1 < K ? xb[row * K + 2 * j + 1] : 0;
    return lo | (static_cast<uint32_t>(hi) << 16);
  }
  const uint16_t lo = c10::BFloat16(xf[row * K + 2 * j]).x;
  const uint16_t hi = 2 * j + 1 < K ? c10::BFloat16(xf[row * K + 2 * j + 1]).x : 0;
  return lo | (static_cast<uint32_t>(hi) << 16);
}
#endif

// x [M, K] bf16 or fp32; packed from tile_gemm_pack of an [n, K] weight; bias [n] (bf16 or
// fp32) or empty -> [M, n] in x's dtype.
torch::Tensor tile_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
#if TL_TILE_GEMM
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kBFloat16 ||
                                x.scalar_type() == torch::kFloat32),
              "tile_gemm: x [M, K] bf16 or fp32");
  const bool f32 = x.scalar_type() == torch::kFloat32;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kInt32 &&
                  packed.size(2) == kPW && packed.is_contiguous() &&
                  packed.size(1) == (x.size(1) + 1) / 2,
              "tile_gemm: a packed weight (tile_gemm_pack) matching x");
  const int64_t n = packed.size(0) * kPW;
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "tile_gemm: bias [n] or empty");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), K2 = packed.size(1), P = packed.size(0);
  auto y = torch::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return y;
  torch::Tensor bias32;
  if (bias.numel() > 0) bias32 = bias.to(torch::kFloat32).contiguous();
  const float* bp = bias.numel() > 0 ? bias32.data_ptr<float>() : nullptr;
  const uint16_t* xp =
      f32 ? nullptr : reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const float* xfp = f32 ? xc.data_ptr<float>() : nullptr;
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  uint16_t* yp = f32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  float* yfp = f32 ? y.data_ptr<float>() : nullptr;
  const int64_t tiles = (M + kMR - 1) / kMR, groups = (P + kNV - 1) / kNV;
  static thread_local std::vector<uint32_t> abuf;   // the packed x tiles, kept between calls
  if (static_cast<int64_t>(abuf.size()) < tiles * K2 * kMR) abuf.resize(tiles * K2 * kMR);
  uint32_t* ap = abuf.data();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles * kMR; ++i) {        // x rows into their tiles' words
      const int64_t t = i / kMR, r = i % kMR, row = t * kMR + r;
      uint32_t* dst = ap + t * K2 * kMR + r;
      if (row >= M) {
        for (int64_t j = 0; j < K2; ++j) dst[j * kMR] = 0u;
        continue;
      }
      for (int64_t j = 0; j < K2; ++j) dst[j * kMR] = pair_word(xp, xfp, row, K, j);
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p0 = g * kNV;
      const int nv = static_cast<int>(std::min<int64_t>(kNV, P - p0));
      const uint32_t* w = wp + p0 * K2 * kPW;
      __m512 acc[kMR][kNV];
      for (int64_t t = 0; t < tiles; ++t) {
        const uint32_t* a = ap + t * K2 * kMR;
        if (nv == 3) micro<3>(a, w, K2, acc);
        else if (nv == 2) micro<2>(a, w, K2, acc);
        else micro<1>(a, w, K2, acc);
        const int64_t rows = std::min<int64_t>(kMR, M - t * kMR);
        if (f32) store_tile(acc, nv, rows, p0, n, bp, yfp, t * kMR);
        else store_tile(acc, nv, rows, p0, n, bp, yp, t * kMR);
      }
    }
  }
  return y;
#else
  TORCH_CHECK(false, "tile_gemm: built without AVX512-BF16");
  return x;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("tile_gemm(Tensor x, Tensor packed, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("tile_gemm", &tile_gemm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tile_gemm", &tile_gemm, "x . W^T (+ bias) on vdpbf16ps over a packed bf16 weight");
  m.def("tile_gemm_pack", &tile_gemm_pack, "a [N, K] bf16 weight into tile_gemm's panels");
  m.def("tile_gemm_built", &tile_gemm_built, "whether the AVX512-BF16 kernel was compiled");
}
