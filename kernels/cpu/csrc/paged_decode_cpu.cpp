// Paged-attention decode for the CPU: one query token per sequence, keys and values read
// straight from the block pool through each sequence's block table (no gathered copy).
//
// Work item = a span of up to 256 keys of one sequence (kSpan); all its heads are processed
// together so every key/value row ([kv_heads, head_dim], contiguous in its block) is loaded
// once, in order. Two passes over the span: scores (q . k) then the weighted sum of values;
// softmax partials in fp32 in between, merged per sequence at the end. (The quantized
// cache's kernel below still takes a whole sequence per item.)
// Decode attention is memory-bound: each pass prefetches one block ahead (prefetch_row).
//
// Built with -fopenmp (kernels/cpu/attention.py): without it at::parallel_for compiles to a plain
// loop and every sequence runs on the calling thread. (Splitting a sequence's kv heads
// across threads was measured too: no faster for a lone sequence, slower when one thread;
// splitting its context is what lets a lone long decode use both cores.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "prefill_attention.h"

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// Ask for a K/V row of a later block now. Blocks sit anywhere in the pool, so the hardware
// prefetcher stalls at every block boundary; loading the row one block ahead keeps the
// next block in flight while this one is computed on (~2x on contexts that are not in the
// cache, which is every real step: each layer reads its own KV).
template <typename T>
static inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(p + i);
}

// Keys per work item: a sequence's context is cut into spans of this many keys, each
// computed by one thread (softmax partials: the span's max, sum and weighted values), then
// merged. A fixed span, not one derived from the thread count or the batch, so a
// sequence's result is the same whatever else is in the step and however many threads run
// (a lone 1,100-token decode spreads over every core instead of one).
constexpr int64_t kSpan = 256;

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t BS, int64_t max_blocks, int64_t blk_stride,
                          int64_t row_stride, float scale) {
  const int64_t G = H / KVH;
  std::vector<int64_t> first(B + 1, 0);   // sequence b's spans are items first[b]..first[b+1]
  for (int64_t b = 0; b < B; ++b)
    first[b + 1] = first[b] + std::max<int64_t>(1, (lens[b] + kSpan - 1) / kSpan);
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
      const int64_t t0 = (item - first[b]) * kSpan, t1 = std::min(ctx, t0 + kSpan);
      const int64_t n = std::max<int64_t>(t1 - t0, 0);
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_f(q[b * H * D + i]) * scale;
      scores.assign(H * n, 0.f);
      // Pass 1: scores[h, t] = q_h . k_t(kv head of h)
      for (int64_t t = t0; t < t1; ++t) {
        const T* k = kc + table[t / BS] * blk_stride + (t % BS) * row_stride;
        if (t + BS < ctx) prefetch_row(kc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        const float* kf;
        if constexpr (std::is_same_v<T, float>) {
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
        const T* v = vc + table[t / BS] * blk_stride + (t % BS) * row_stride;
        if (t + BS < ctx) prefetch_row(vc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        const float* vf;
        if constexpr (std::is_same_v<T, float>) {
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

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                            value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                            context_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH,
                            D, BS, max_blocks, blk_stride, row_stride, static_cast<float>(scale));
  });
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
                            int64_t D, int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH, row_stride = KVH * D, blk_stride = BS * row_stride;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores, row(row_stride), pv(KVH);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_f(q[b * H * D + i]) * scale;
      scores.assign(H * ctx, 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t blk = table[t / BS];
        if (t + BS < ctx) prefetch_row(kc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        decode_row(kc + blk * blk_stride + (t % BS) * row_stride, row.data(), row_stride, kfmt);
        const float* sc = ks + (blk * BS + t % BS) * KVH;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = &qf[h * D];
          const float* kh = row.data() + (h / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[h * ctx + t] = s * sc[h / G];
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* s = &scores[h * ctx];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t blk = table[t / BS];
        if (t + BS < ctx) prefetch_row(vc + table[t / BS + 1] * blk_stride + (t % BS) * row_stride, row_stride);
        decode_row(vc + blk * blk_stride + (t % BS) * row_stride, row.data(), row_stride, vfmt);
        const float* sc = vs + (blk * BS + t % BS) * KVH;
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * ctx + t] * sc[h / G];
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
                             double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
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
    decode_kernel_q<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<uint8_t>(),
                              value_cache.data_ptr<uint8_t>(), key_scale.data_ptr<float>(),
                              value_scale.data_ptr<float>(), static_cast<int>(kfmt),
                              static_cast<int>(vfmt), block_tables.data_ptr<int64_t>(),
                              context_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H,
                              KVH, D, BS, block_tables.size(1), static_cast<float>(scale));
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
// decode program) is skipped in place, without filtering on the host.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slots) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64, "slots must be int64");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
              "key/value and cache dtypes differ");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "each token's K/V rows must be contiguous");
  slots = slots.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = key_cache.numel() / row;
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
}

// The same kernels as dispatcher operators, so that a compiled (torch.compile) decode
// program can call them (graphs/cpu_compile.py registers their shape functions).
TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("paged_decode_cpu(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("store_kv_cpu(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("paged_decode_cpu", &paged_decode);
  m.impl("store_kv_cpu", &store_kv);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged-attention decode over the block pool (CPU)");
  m.def("paged_decode_q", &paged_decode_q, "paged-attention decode over a quantized pool (CPU)");
  m.def("store_kv", &store_kv, "write K/V rows into their cache slots, skipping slot < 0");
  m.def("prefill_attention", &prefill_attention, "causal prefill attention (CPU)");
  m.def("prefill_bf16_dot_built", &prefill_bf16_dot_built,
        "whether bf16 prefill attention runs the AVX512-BF16 kernel");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses for n items");
}
