// y[M, N] = x[M, K] . W[N, K]^T (+ bias) with W in 32-weight blocks, as GGUF stores them:
//
//   q4: 16 bytes of nibbles + an fp16 scale d + an fp16 min m per block (GGUF Q4_1; Q4_0 is
//       the same with m = -8 d). Byte j of a block holds weight j in its low nibble and
//       weight j + 16 in its high nibble. w = d * q + m.
//   q8: 32 int8 + an fp16 scale d per block (GGUF Q8_0). w = d * q.
//
// The weights are read as they are stored, once per call whatever M: every call walks W
// row by row and multiplies each block with up to 4 activation rows while it is in L1. So a
// decode step streams 0.625 (q4) or 1.0625 (q8) bytes per weight, and a prefill chunk never
// dequantizes the whole matrix.
//
// The activations are quantized per call to int8 blocks of 32 (scale dx = max|x| / 127), as
// llama.cpp does for these formats: a block's 32 products are then summed exactly in
// integers, and sum_j (d q_j + m) x_j = d dx sum_j q_j xq_j + m dx sum_j xq_j. Widening
// every weight to fp32 instead measured compute-bound on a 2-core AVX2 machine (29 ms a
// step for 96 MB of q4 weights, slower than fp32's 35 ms for 538 MB).
//
// AVX2 (+FMA, F16C; also what an AVX-512 machine runs) when the compiler targets it
// (-march=native); otherwise plain loops over the same integer blocks. Whether this kernel
// or a kept dequantized copy serves a row count is measured at start-up
// (kernels/cpu/linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TL_AVX2 1
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

// One weight row against MS activation rows quantized to int8 blocks (xq, with scale dx and
// dx * sum(xq) per block, as llama.cpp's Q8_1): the 32 products of a block are summed
// exactly in integers (maddubs: u8 x s8 -> s16 pairs, then madd -> s32), converted once and
// scaled by d_w * d_x. A 4-bit code times an int8 is at most 15 * 127 * 2 per pair, an 8-bit
// product pair at most 127 * 127 * 2: neither saturates int16.
template <Fmt F, int MS>
inline void row_dot(const uint8_t* q, const uint16_t* d, const uint16_t* mn, const int8_t* xq,
                    const float* dx, const float* sx, int64_t K, int64_t nb, float* out) {
  __m256 acc[MS];
  float macc[MS];
  for (int m = 0; m < MS; ++m) { acc[m] = _mm256_setzero_ps(); macc[m] = 0.f; }
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
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
                    const float* dx, const float* sx, int64_t K, int64_t nb, float* out) {
  float acc[MS] = {};
  float w[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
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

template <Fmt F>
void run(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
         const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
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

std::string simd_path() {
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
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, lib) {
  lib.impl("q4_gemm", &q4_gemm);
  lib.impl("q8_gemm", &q8_gemm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_gemm", &q4_gemm, "x . W^T with W in GGUF Q4_1-style 32-weight blocks");
  mod.def("q8_gemm", &q8_gemm, "x . W^T with W in GGUF Q8_0-style 32-weight blocks");
  mod.def("simd_path", &simd_path, "which SIMD path was compiled");
}
