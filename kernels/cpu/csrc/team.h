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
// The kernels live in their own extension modules (block_gemm_cpu.cpp, small_gemm_cpu.cpp,
// tile_gemm_cpu.cpp, paged_decode_cpu.cpp); each exports a factory (a capsule) that makes the objects below,
// whose work is split by (part, parts): the same tiles and the same sums as the kernel's
// operator, so a team step's output is bit-identical to the per-call one.
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace tl_team {

// A projection's kernel for M activation rows of width K, in the activations' dtype (fp32,
// or bf16: results rounded to bf16 as the operator rounds them): prepare() readies the
// activations (one thread: q4 / q8 quantize them to int8 blocks, others widen bf16 or keep
// the pointer), rows() computes share `part` of `parts` of y = x . W^T (* scale) + bias.
struct Weights {
  const void* data;     // q4 nibbles / q8 codes (packed layout), rows [n, K] (small_gemm),
                        // or tile panels [n / 16, K, 16]
  const void* scales;   // q4 / q8: fp16 block scales; int8 rows: fp32 per row; else null
  const void* mins;     // q4: fp16 block mins; else null
  const float* bias;    // fp32, or null
  int64_t n;            // weight rows (y's width)
};

class Projection {
 public:
  virtual ~Projection() = default;
  virtual void prepare(const void* x) = 0;
  virtual void rows(const Weights& w, void* y, int part, int parts) const = 0;
};

// The kernels a module makes (each module's factory takes its own): block_gemm_cpu.cpp
// kQ4Packed / kQ8Packed; small_gemm_cpu.cpp kSmallRows (small_gemm) / kSmallStrips
// (small_gemm_strips); tile_gemm_cpu.cpp's FMA body kTileF32, kTileBf16 (tile_gemm; fp32
// x rounded to bf16 first), kTileInt8 (tile_gemm_int8, fp32 scales per output row).
enum ProjectionKind : int {
  kQ4Packed = 0, kQ8Packed = 1, kSmallRows = 2, kSmallStrips = 3, kTileF32 = 4,
  kTileBf16 = 5, kTileInt8 = 6, kProjectionKinds = 7
};
// A weight's element where the kind takes several (small_gemm): fp32, bf16, int8.
enum WeightElem : int { kElemF32 = 0, kElemBf16 = 1, kElemInt8 = 2 };
// The module whose factory makes a kind: 0 block_gemm, 1 small_gemm, 2 tile_gemm.
inline int module_of(int kind) { return kind <= kQ8Packed ? 0 : kind <= kSmallStrips ? 1 : 2; }
// Null when this build would not serve the operator's call with this body (then the stack
// takes the per-call path).
using MakeProjection = Projection* (*)(int kind, int elem, int64_t m, int64_t k, bool bf16);
constexpr const char* kBlockCapsule = "tokenloom.team.block_gemm";
constexpr const char* kSmallCapsule = "tokenloom.team.small_gemm";
constexpr const char* kTileCapsule = "tokenloom.team.tile_gemm";

// The paged decode attention's vector path (paged_decode_cpu.cpp) for one step's decode
// rows (query and output in the activations' dtype): bind() (one thread, per layer) points it at a layer's query, cache and output;
// items() is run by every thread (each takes spans from a shared counter); merge() (one
// thread) combines the spans into the output.
class DecodeAttention {
 public:
  virtual ~DecodeAttention() = default;
  virtual void bind(const void* q, const void* kc, const void* vc, void* out) = 0;
  virtual void items(int part) = 0;
  virtual void merge() = 0;
};

// query: 0 fp32, 1 bf16; pool: 0 fp32, 1 bf16, 2 fp16 (under an fp32 query). Null when
// there is no vector path for it (or it is turned off).
struct AttentionShape {
  int query, pool;
  const int64_t* tables;
  const int64_t* lens;
  int64_t b, h, kvh, d, block_size, max_blocks, blk_stride, row_stride;
  float scale;
  int parts;
};
using MakeDecodeAttention = DecodeAttention* (*)(const AttentionShape& shape);
constexpr const char* kAttentionCapsule = "tokenloom.team.decode_attention";

// A barrier whose last arriver runs the serial work before releasing the others. Waiters
// spin (the team owns the cores for the step), then yield: a thread the OS has descheduled
// (another process on the cores) gets its core back. The decode stack takes the team only
// when its threads do not outnumber the CPUs it may run on (usable_cpus): 4 threads on 2
// cores, spinning 16,384 pauses before each yield, made a q4 step 7x slower (70 vs 10.5 ms
// for the per-call path).
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
      if (spins < kSpins) {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int64_t kSpins = 1 << 12;   // ~0.1 ms of pauses, then yields
  const int n_;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
};

// The CPUs this process may run on (its affinity mask), or the machine's.
inline int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace tl_team
