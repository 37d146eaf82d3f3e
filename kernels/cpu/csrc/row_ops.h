// Row loops shared by the C++ layer ops (layer_ops_cpu.cpp) and the decode stack
// (decode_stack_cpu.cpp): residual add + RMSNorm, and SiLU(gate) * up, each one pass over a
// row, fp32. Rows are spread over threads; a decode step's few rows run inline. And the
// rounding of a K/V value into the pool's dtype (also paged_decode_cpu.cpp's store).
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace tl_rows {

// A K or V value stored in a pool of element C (cache.kv_dtype): rounded to nearest; into
// fp16, clamped to its largest finite value first, so an outlier stays a large number
// instead of becoming inf (and every attention weight of its row NaN).
template <typename C, typename S>
inline C to_pool(S x) {
  if constexpr (std::is_same_v<C, c10::Half>)
    return static_cast<C>(std::clamp(static_cast<float>(x), -65504.f, 65504.f));
  else
    return static_cast<C>(x);
}

// y = rmsnorm(residual + x) * w with residual updated in place, or rmsnorm(x) * w when
// residual is null.
inline void norm_rows(float* x, float* residual, const float* w, float* y, int64_t rows,
                      int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * n;
      float* src = xr;
      if (residual != nullptr) {   // residual += x; the norm reads the updated residual
        float* rr = residual + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) rr[j] += xr[j];
        src = rr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < n; ++j) ss += src[j] * src[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      float* yr = y + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = src[j] * inv * w[j];
    }
  });
}

// gate_up [rows, 2 * inter] -> y [rows, inter] = silu(gate) * up.
inline void silu_mul_rows(const float* g, float* y, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = g + r * 2 * inter;
      const float* ur = gr + inter;
      float* yr = y + r * inter;
#pragma omp simd
      for (int64_t j = 0; j < inter; ++j) yr[j] = gr[j] / (1.f + std::exp(-gr[j])) * ur[j];
    }
  });
}

}  // namespace tl_rows
