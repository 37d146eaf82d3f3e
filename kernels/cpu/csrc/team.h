// One OpenMP team for a whole decode step (decode_stack_cpu.cpp's team path).
//
// Each projection and the attention of a layer was its own at::parallel_for: a fork and a
// join of the OpenMP team per call, ~1.25 us on a 2-core Zen 3 (an empty parallel_for,
// 20,000 in a row), five calls a layer, 150 a step of the default model, plus the operator
// call around each. Inside one parallel region the threads instead meet at a spin barrier
// (~0.1 us on the same machine; libgomp's own barrier ~0.5 us), and the serial work between
// two kernels (norms, RoPE and the KV store, SiLU, quantizing the next activations) runs on
// the last thread to arrive, so a layer costs 5 meetings.
//
// The kernels live in their own extension modules (block_gemm_cpu.cpp,
// paged_decode_cpu.cpp); each exports a factory (a capsule) that makes the objects below,
// whose work is split by (part, parts): the same tiles and the same sums as the kernel's
// operator, so a team step's output is bit-identical to the per-call one.
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace tl_team {

// A block projection (block_gemm_cpu.cpp's packed q4 / q8 kernels) for M activation rows of
// width K: prepare() quantizes them (one thread), rows() computes share `part` of `parts` of
// y = x . W^T + bias.
struct BlockWeights {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* mn;   // q4's mins (null for q8)
  const float* bias;    // or null
  int64_t n;            // weight rows (y's width)
};

class BlockCall {
 public:
  virtual ~BlockCall() = default;
  virtual void prepare(const float* x) = 0;
  virtual void rows(const BlockWeights& w, float* y, int part, int parts) const = 0;
};

// fmt: 0 q4, 1 q8 (the packed layout). Null when this build has no packed kernels.
using MakeBlockCall = BlockCall* (*)(int fmt, int64_t m, int64_t k);
constexpr const char* kBlockCapsule = "tokenloom.team.block_call";

// The paged decode attention's vector path (paged_decode_cpu.cpp) for one step's decode
// rows: bind() (one thread, per layer) points it at a layer's query, cache and output;
// items() is run by every thread (each takes spans from a shared counter); merge() (one
// thread) combines the spans into the output.
class DecodeAttention {
 public:
  virtual ~DecodeAttention() = default;
  virtual void bind(const float* q, const void* kc, const void* vc, float* out) = 0;
  virtual void items(int part) = 0;
  virtual void merge() = 0;
};

// pool: 0 fp32, 1 bf16, 2 fp16 (under an fp32 query). Null when there is no vector path
// for it (or it is turned off).
struct AttentionShape {
  int pool;
  const int64_t* tables;
  const int64_t* lens;
  int64_t b, h, kvh, d, block_size, max_blocks, blk_stride, row_stride;
  float scale;
  int parts;
};
using MakeDecodeAttention = DecodeAttention* (*)(const AttentionShape& shape);
constexpr const char* kAttentionCapsule = "tokenloom.team.decode_attention";

// A barrier whose last arriver runs the serial work before releasing the others. Waiters
// spin (the team owns the cores for the step), yielding after 16,384 pauses (a few hundred
// microseconds) in case the threads outnumber the cores.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}

  template <typename F>
  void arrive(F&& serial) {
    const int g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      serial();
      count_.store(0, std::memory_order_relaxed);
      gen_.store(g + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; gen_.load(std::memory_order_acquire) == g; ++spins) {
      if (spins < (1 << 14)) {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  const int n_;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
};

}  // namespace tl_team
