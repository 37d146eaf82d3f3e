// Register-tiled projections for mixed and prefill-sized steps (and batched decode, where
// the plan measures them fastest): y[M, N] = x[M, K] . W[N, K]^T (+ bias), fp32 sums.
//
// tile_gemm: bf16 weights, bf16 x and y (or fp32 x, rounded to bf16 to nearest even as it
// is packed, and fp32 y, its sums not rounded: the q4/q8 models' dequantized bf16 copy,
// "copy_tile_bf16" in kernels/cpu/linear.py, runs on it). Two bodies:
// - AVX512-BF16 (vdpbf16ps). oneDNN's bf16 matmul on prepacked weights ran the default
//   model's 30 layers of projections at ~300 GFLOP/s for an 80-row step (16 decodes + a
//   64-token chunk: the step SLO chunking takes under load) against ~400 at 512 rows, on a
//   2-core AVX-512 machine: small chunks paid a quarter more per token. This is the
//   textbook register-tiled kernel sized for such steps.
// - AVX2 + FMA (no bf16 dot instruction): panels of 16 outputs x K bf16 (tile_gemm_pack
//   packs for the body built), each k's 16 weights widened in registers (zero-extend, shift
//   left 16: the bits of a bf16 are the top half of its fp32), x widened to fp32 once per
//   call, 6 rows x 16 outputs of fp32 sums (12 of the 16 ymm registers; the classic AVX2
//   tile). small_gemm_strips, which widens each weight once per 4 x rows into 4 x 4 sums
//   that spill on 16 registers, ran a 16-row step's bf16 projections at ~35% of the FMA
//   peak (a 2-core Zen 3); this tile runs them at ~90% (1.9x faster).
//
// tile_gemm_int8: int8 weights with per-output fp32 scales (the int8 mode: fp32 or bf16
// activations, the weight's scale applied to the finished sum), packed in panels of 16
// outputs x K bytes, widened in registers (sign-extend + convert), the same 6 x 16 tile.
// AVX2 + FMA (an AVX-512 build has them too).
//
// tile_gemm_f32: fp32 weights and x, the same tile without the widening (panels of 16
// outputs x K floats), for fp32 models' batched and prefill-sized calls.
//
// Layout and threads:
// - W is packed once, at load, into panels of 16 output columns: for vdpbf16ps, panel p is
//   [K/2][16] 32-bit words, word (j, l) = the bf16 pair (W[16p + l, 2j], W[16p + l, 2j + 1]),
//   which is what vdpbf16ps multiplies lane-wise; on the FMA body [K][16] weights (bf16,
//   int8 or fp32). N must be a multiple of 16 (every projection of the models served here;
//   linear.py offers the kernels only then).
// - x is packed per call into row tiles (bf16 pairs for vdpbf16ps, fp32 otherwise), so a
//   tile's broadcasts for one k are adjacent.
// - The micro-kernel keeps a tile's rows x its panels of fp32 sums in registers over the
//   whole of K.
// - Threads split the panels; each walks every row tile over its panels, so a panel is
//   read from memory once a call and from L1/L2 after the first tile.
//
// Which kernel runs at which row count is measured at start-up (kernels/cpu/linear.py).
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include <omp.h>

#include "team.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define TL_TILE_DPBF16 1
#else
#define TL_TILE_DPBF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TL_TILE_FMA 1
#else
#define TL_TILE_FMA 0
#endif
#define TL_TILE_GEMM (TL_TILE_DPBF16 || TL_TILE_FMA)

namespace {

constexpr int64_t kMR = 8;    // rows per tile
constexpr int64_t kPW = 16;   // output columns per panel
constexpr int kNV = 3;        // panels per micro-kernel call

// [N, K] bf16 -> the panels of the path built: for vdpbf16ps [N / 16, ceil(K / 2), 16]
// int32 (the pair words above); for the FMA path [N / 16, K, 16] int16 (the bf16 bits).
torch::Tensor tile_gemm_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(0) % kPW == 0,
              "tile_gemm_pack: a 2-d bf16 weight with a multiple of 16 rows");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = N / kPW, K2 = (K + 1) / 2;
  if (!TL_TILE_DPBF16)
    return wc.view(torch::kInt16).view({P, kPW, K}).transpose(1, 2).contiguous();
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

// Which body tile_gemm runs: "dpbf16", "fma" or "" (not built).
std::string tile_gemm_path() { return TL_TILE_DPBF16 ? "dpbf16" : (TL_TILE_FMA ? "fma" : ""); }

#if TL_TILE_DPBF16
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

#if TL_TILE_FMA
constexpr int64_t kMR8 = 6;   // rows per tile on the FMA path (6 x 2 sums: 12 ymm registers)

// bf16 bits -> fp32 (exact).
static inline float widen_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp32 -> bf16, rounded to nearest even, NaN kept a (quiet) NaN: c10::BFloat16's rounding,
// 8 lanes at a time.
static inline __m128i round_bf16_8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Rows [m0, m0 + rows) of y for the 16 outputs at n0: sums * scale (int8) + bias, rounded
// to bf16 (Y = uint16_t) or as they are (Y = float).
template <typename Y>
static inline void store_tile8(const __m256 (&acc)[kMR8][2], int64_t rows, int64_t n0,
                               int64_t N, const float* scale, const float* bias, Y* y,
                               int64_t m0) {
  for (int h = 0; h < 2; ++h) {
    const __m256 s = scale != nullptr ? _mm256_loadu_ps(scale + n0 + 8 * h) : _mm256_set1_ps(1.f);
    const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + n0 + 8 * h) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 v = scale != nullptr ? _mm256_fmadd_ps(acc[r][h], s, b)
                                        : _mm256_add_ps(acc[r][h], b);
      Y* dst = y + (m0 + r) * N + n0 + 8 * h;
      if constexpr (std::is_same_v<Y, float>)
        _mm256_storeu_ps(dst, v);
      else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), round_bf16_8(v));
    }
  }
}

// How a panel's 16 weights at one k become two fp32 vectors, per weight format: bf16
// (zero-extend, shift left 16), int8 (sign-extend, convert), fp32 (as they are). (The
// vdpbf16ps body's pair words, split by a shift and an and-mask, needed a 17th register for
// the mask, spilled a sum and ran at 2/3 of this loop's rate: hence [K][16] bf16 here.)
struct WidenBf16 {
  using W = uint16_t;
  static inline void load(const uint16_t* wk, __m256& w0, __m256& w1) {
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk))), 16));
    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 8))), 16));
  }
};
struct WidenInt8 {
  using W = int8_t;
  static inline void load(const int8_t* wk, __m256& w0, __m256& w1) {
    w0 = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk))));
    w1 = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk + 8))));
  }
};
struct WidenF32 {
  using W = float;
  static inline void load(const float* wk, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(wk);
    w1 = _mm256_loadu_ps(wk + 8);
  }
};

// A panel (K x 16 weights) times a tile of R rows, a = [K][kMR8] fp32: per k, the two
// weight vectors meet R broadcasts, 2 R FMAs. 6 rows: 12 sums + 2 weights + a broadcast,
// 15 of AVX2's 16 registers. The sums are locals: through `out` (a reference to memory)
// GCC kept them in memory, a load and a store around every FMA (2/3 of this loop's rate).
// Under 4 rows, interleaved sets of sums over k (to hide the FMA latency) measured no
// faster (bf16 at 1 row, 30 layers: 8.2-9.5 ms with one set, 9.1-9.6 with four).
template <typename Wd, int R>
static inline void micro_fma(const float* a, const typename Wd::W* w, int64_t K,
                             __m256 (&out)[kMR8][2]) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    Wd::load(w + k * kPW, w0, w1);
    const float* ak = a + k * kMR8;
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(ak + r);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) out[r][0] = acc[r][0], out[r][1] = acc[r][1];
}

// The tile of rows [m0, m0 + rows) through one panel: R as a compile-time count, so that
// the sums stay in registers.
template <typename Micro>
static inline void by_rows(int64_t rows, Micro&& micro) {
  switch (rows) {
    case 1: micro(std::integral_constant<int, 1>{}); break;
    case 2: micro(std::integral_constant<int, 2>{}); break;
    case 3: micro(std::integral_constant<int, 3>{}); break;
    case 4: micro(std::integral_constant<int, 4>{}); break;
    case 5: micro(std::integral_constant<int, 5>{}); break;
    default: micro(std::integral_constant<int, 6>{}); break;
  }
}

// x [M, K] (fp32, or bf16 widened; `round` rounds fp32 to bf16 first) into row tiles of
// kMR8, a[t][k][r]. Rows past M are never read (a tile's R stops at M).
static void pack_rows8(const uint16_t* xb, const float* xf, bool round, int64_t M, int64_t K,
                       float* a) {
#pragma omp parallel for schedule(static) if (M * K > 16384)
  for (int64_t row = 0; row < M; ++row) {
    float* tile = a + (row / kMR8) * K * kMR8 + row % kMR8;
    for (int64_t k = 0; k < K; ++k) {
      float v;
      if (xb != nullptr) v = widen_bf16(xb[row * K + k]);
      else v = round ? widen_bf16(c10::BFloat16(xf[row * K + k]).x) : xf[row * K + k];
      tile[k * kMR8] = v;
    }
  }
}

// Panels [p0, p1) of y (16 outputs each), every row tile of x (a, from pack_rows8) through
// each panel while it is in L1/L2. Not inlined: the operator's threads and the decode
// stack's team (team.h) run this one compiled body, so that their results are
// bit-identical (-ffast-math lets two inlined copies order a sum differently).
// y: bf16 (`yb`) or fp32 (`yf`), a branch per tile: a template per result type instead
// made the bf16 one 1.8x slower at 16 rows (3,072 x 576: 343 -> 602 us), the same loop.
template <typename Wd>
__attribute__((noinline)) static void fma_panels(const float* a, int64_t M, int64_t K,
                                                 const typename Wd::W* wp, const float* scale,
                                                 const float* bias, uint16_t* yb, float* yf,
                                                 int64_t n, int64_t p0, int64_t p1) {
  const int64_t tiles = (M + kMR8 - 1) / kMR8, tile_floats = K * kMR8;
  for (int64_t p = p0; p < p1; ++p) {
    __m256 acc[kMR8][2];
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = std::min<int64_t>(kMR8, M - t * kMR8);
      by_rows(rows, [&](auto R) {
        micro_fma<Wd, decltype(R)::value>(a + t * tile_floats, wp + p * K * kPW, K, acc);
      });
      if (yf != nullptr) store_tile8(acc, rows, p * kPW, n, scale, bias, yf, t * kMR8);
      else store_tile8(acc, rows, p * kPW, n, scale, bias, yb, t * kMR8);
    }
  }
}

// y = x . W^T (* scale) (+ bias) on the FMA body for weight format Wd: x (bf16 `xb` or fp32
// `xf`; `round`: fp32 x rounded to bf16 first) widened into row tiles kept between calls,
// then the panels split between threads; y bf16 (`yb`) or fp32 (`yf`).
template <typename Wd>
static void run_fma(const uint16_t* xb, const float* xf, bool round, int64_t M, int64_t K,
                    int64_t P, const typename Wd::W* wp, const float* scale, const float* bias,
                    uint16_t* yb, float* yf) {
  const int64_t n = P * kPW, tiles = (M + kMR8 - 1) / kMR8, tile_floats = K * kMR8;
  static thread_local std::vector<float> abuf;
  if (static_cast<int64_t>(abuf.size()) < tiles * tile_floats) abuf.resize(tiles * tile_floats);
  float* ap = abuf.data();
  pack_rows8(xb, xf, round, M, K, ap);
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t p0 = P * id / nt, p1 = P * (id + 1) / nt;
    fma_panels<Wd>(ap, M, K, wp, scale, bias, yb, yf, n, p0, p1);
  }
}

// The FMA body for the decode stack's team (team.h): x (fp32, or bf16 for bf16
// activations, whose results are rounded to bf16) widened into row tiles kept by the
// object, the panels split by part (the tiles and sums run_fma's threads compute). Wd:
// WidenF32 (tile_gemm_f32), WidenBf16 (tile_gemm; fp32 x rounded to bf16 first),
// WidenInt8 (tile_gemm_int8, per-output scales).
template <typename Wd>
class TeamTile final : public tl_team::Projection {
 public:
  TeamTile(int64_t M, int64_t K, bool round, bool bf16)
      : M_(M), K_(K), round_(round), bf16_(bf16), a_(((M + kMR8 - 1) / kMR8) * K * kMR8) {}
  void prepare(const void* x) override {
    if (bf16_) pack_rows8(static_cast<const uint16_t*>(x), nullptr, false, M_, K_, a_.data());
    else pack_rows8(nullptr, static_cast<const float*>(x), round_, M_, K_, a_.data());
  }
  void rows(const tl_team::Weights& w, void* y, int part, int parts) const override {
    const int64_t P = w.n / kPW, p0 = P * part / parts, p1 = P * (part + 1) / parts;
    const auto* wp = static_cast<const typename Wd::W*>(w.data);
    const auto* scale = static_cast<const float*>(w.scales);
    fma_panels<Wd>(a_.data(), M_, K_, wp, scale, w.bias,
                   bf16_ ? static_cast<uint16_t*>(y) : nullptr,
                   bf16_ ? nullptr : static_cast<float*>(y), w.n, p0, p1);
  }

 private:
  int64_t M_, K_;
  bool round_, bf16_;
  std::vector<float> a_;
};
#endif

// Null where the kernel would not take the FMA body (a vdpbf16ps build's bf16 panels).
tl_team::Projection* make_team_projection(int kind, int, int64_t M, int64_t K, bool bf16) {
#if TL_TILE_FMA
  if (M <= 0 || K <= 0) return nullptr;
  if (kind == tl_team::kTileF32 && !bf16) return new TeamTile<WidenF32>(M, K, false, false);
  if (kind == tl_team::kTileInt8) return new TeamTile<WidenInt8>(M, K, false, bf16);
#if !TL_TILE_DPBF16
  if (kind == tl_team::kTileBf16) return new TeamTile<WidenBf16>(M, K, true, bf16);
#endif
#endif
  (void)kind; (void)M; (void)K; (void)bf16;
  return nullptr;
}

// x [M, K] bf16 or fp32; packed from tile_gemm_pack of an [n, K] weight; bias [n] (bf16 or
// fp32) or empty -> [M, n] in x's dtype.
torch::Tensor tile_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
#if TL_TILE_GEMM
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kBFloat16 ||
                                x.scalar_type() == torch::kFloat32),
              "tile_gemm: x [M, K] bf16 or fp32");
  const bool f32 = x.scalar_type() == torch::kFloat32;
  TORCH_CHECK(packed.dim() == 3 &&
                  packed.scalar_type() == (TL_TILE_DPBF16 ? torch::kInt32 : torch::kInt16) &&
                  packed.size(2) == kPW && packed.is_contiguous() &&
                  packed.size(1) == (TL_TILE_DPBF16 ? (x.size(1) + 1) / 2 : x.size(1)),
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
  uint16_t* yp = f32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  float* yfp = f32 ? y.data_ptr<float>() : nullptr;
#if TL_TILE_DPBF16
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
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
#else
  (void)K2;
  run_fma<WidenBf16>(xp, xfp, /*round=*/true, M, K, P,
                     reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>()), nullptr,
                     bp, yp, yfp);
#endif
  return y;
#else
  TORCH_CHECK(false, "tile_gemm: built without AVX512-BF16 or AVX2 + FMA");
  return x;
#endif
}

// [N, K] int8 -> [N / 16, K, 16] int8 (tile_gemm_int8's panels).
torch::Tensor tile_gemm_int8_pack(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.size(0) % kPW == 0,
              "tile_gemm_int8_pack: a 2-d int8 weight with a multiple of 16 rows");
  const int64_t N = q.size(0), K = q.size(1);
  return q.contiguous().view({N / kPW, kPW, K}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 or bf16 (widened exactly); packed from tile_gemm_int8_pack of an [n, K]
// int8 weight; scale [n] fp32; bias [n] or empty -> [M, n] in x's dtype:
// y = (x . q^T) * scale + bias, sums in fp32.
torch::Tensor tile_gemm_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                             torch::Tensor bias) {
#if TL_TILE_FMA
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kBFloat16 ||
                                x.scalar_type() == torch::kFloat32),
              "tile_gemm_int8: x [M, K] bf16 or fp32");
  const bool f32 = x.scalar_type() == torch::kFloat32;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kInt8 &&
                  packed.size(2) == kPW && packed.is_contiguous() &&
                  packed.size(1) == x.size(1),
              "tile_gemm_int8: a packed weight (tile_gemm_int8_pack) matching x");
  const int64_t n = packed.size(0) * kPW;
  TORCH_CHECK(scale.numel() == n && scale.scalar_type() == torch::kFloat32 &&
                  scale.is_contiguous(),
              "tile_gemm_int8: scale [n] fp32");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "tile_gemm_int8: bias [n] or empty");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = packed.size(0);
  auto y = torch::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return y;
  torch::Tensor bias32;
  if (bias.numel() > 0) bias32 = bias.to(torch::kFloat32).contiguous();
  const float* bp = bias.numel() > 0 ? bias32.data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  const uint16_t* xp =
      f32 ? nullptr : reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const float* xfp = f32 ? xc.data_ptr<float>() : nullptr;
  uint16_t* yp = f32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  float* yfp = f32 ? y.data_ptr<float>() : nullptr;
  run_fma<WidenInt8>(xp, xfp, /*round=*/false, M, K, P, packed.data_ptr<int8_t>(), sp, bp, yp,
                     yfp);
  return y;
#else
  TORCH_CHECK(false, "tile_gemm_int8: built without AVX2 + FMA");
  return x;
#endif
}

// [N, K] fp32 -> [N / 16, K, 16] fp32 (tile_gemm_f32's panels).
torch::Tensor tile_gemm_f32_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.size(0) % kPW == 0,
              "tile_gemm_f32_pack: a 2-d fp32 weight with a multiple of 16 rows");
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / kPW, kPW, K}).transpose(1, 2).contiguous();
}

// x [M, K] fp32; packed from tile_gemm_f32_pack of an [n, K] fp32 weight; bias [n] or
// empty -> [M, n] fp32, exact fp32 products and sums (only their order differs from a
// plain matmul's).
torch::Tensor tile_gemm_f32(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
#if TL_TILE_FMA
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32,
              "tile_gemm_f32: x [M, K] fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kFloat32 &&
                  packed.size(2) == kPW && packed.is_contiguous() &&
                  packed.size(1) == x.size(1),
              "tile_gemm_f32: a packed weight (tile_gemm_f32_pack) matching x");
  const int64_t n = packed.size(0) * kPW;
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "tile_gemm_f32: bias [n] or empty");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = packed.size(0);
  auto y = torch::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return y;
  torch::Tensor bias32;
  if (bias.numel() > 0) bias32 = bias.to(torch::kFloat32).contiguous();
  const float* bp = bias.numel() > 0 ? bias32.data_ptr<float>() : nullptr;
  run_fma<WidenF32>(nullptr, xc.data_ptr<float>(), /*round=*/false, M, K, P,
                    packed.data_ptr<float>(), nullptr, bp, nullptr, y.data_ptr<float>());
  return y;
#else
  TORCH_CHECK(false, "tile_gemm_f32: built without AVX2 + FMA");
  return x;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("tile_gemm(Tensor x, Tensor packed, Tensor bias) -> Tensor");
  m.def("tile_gemm_int8(Tensor x, Tensor packed, Tensor scale, Tensor bias) -> Tensor");
  m.def("tile_gemm_f32(Tensor x, Tensor packed, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("tile_gemm", &tile_gemm);
  m.impl("tile_gemm_int8", &tile_gemm_int8);
  m.impl("tile_gemm_f32", &tile_gemm_f32);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("team_factory", []() {
    return pybind11::capsule(reinterpret_cast<void*>(&make_team_projection),
                             tl_team::kTileCapsule);
  }, "the FMA tile kernels for the decode stack's one OpenMP team per step (team.h)");
  m.def("tile_gemm", &tile_gemm, "x . W^T (+ bias) over a packed bf16 weight");
  m.def("tile_gemm_pack", &tile_gemm_pack, "a [N, K] bf16 weight into tile_gemm's panels");
  m.def("tile_gemm_built", &tile_gemm_built, "whether tile_gemm has a body for this CPU");
  m.def("tile_gemm_path", &tile_gemm_path, "tile_gemm's body: dpbf16, fma or empty");
  m.def("tile_gemm_int8", &tile_gemm_int8, "x . (q * scale)^T (+ bias), packed int8 weight");
  m.def("tile_gemm_int8_pack", &tile_gemm_int8_pack, "a [N, K] int8 weight into panels of 16");
  m.def("tile_gemm_f32", &tile_gemm_f32, "x . W^T (+ bias) over a packed fp32 weight");
  m.def("tile_gemm_f32_pack", &tile_gemm_f32_pack, "a [N, K] fp32 weight into panels of 16");
  m.def("tile_gemm_int8_built", []() { return bool(TL_TILE_FMA); },
        "whether tile_gemm_int8 and tile_gemm_f32 were compiled (AVX2 + FMA)");
}
