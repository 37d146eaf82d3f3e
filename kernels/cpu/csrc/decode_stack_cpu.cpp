// A whole decode step's decoder layers in one call from Python (fp32 or bf16 activations, CPU).
//
// A batch-1 step of a small model is mostly not its matmuls: a profile of the default model
// in q4 (30 layers) measured ~11 ms of projections in a 27 ms forward. The rest was one
// Python call per op, ~30 ops a layer (norms, the RoPE chain of cat/neg/mul/add, two KV
// index_copy_s, the module calls around them), each with its dispatch, allocation and
// interpreter time. Here a layer is a loop body: the projections and the attention go
// through the same dispatcher operators the eager forward calls (q4_gemm, q8_gemm,
// small_gemm, paged_decode_cpu: same kernels, same sums), the small ops are one pass each
// over a row, and the layer loop never returns to Python.
//
// The same arithmetic as the eager forward (kernels/models/llama.py) in the same order:
//   h += m; x = rmsnorm(h) * w1            (m: the previous layer's MLP output, 0 first)
//   q, k, v = x . Wqkv^T (+ b); q, k per-head RMSNorm'd where the model has q/k norms
//   (Qwen3), then rotated (rotate-half RoPE from the cos/sin rows)
//   k, v written into the layer's cache at the row's slot (slot < 0: not written)
//   o = attention(q, cache) . Wo^T;  h += o;  x = rmsnorm(h) * w2
//   m = (silu(gate) * up)(x . Wgu^T) . Wdown^T
// and returns h + m. The RoPE products may round differently in the last bit (the compiler
// may fuse a multiply and add); everything else is bit-identical.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>
#include <omp.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "row_ops.h"
#include "team.h"

namespace {

using at::Tensor;

// false: every step takes the per-call path (for tests and side-by-side measurements).
bool g_team = true;

// How a projection runs (kernels/cpu/linear.py's kernel names): the operator and its
// tensor arguments after x. kOneDNN: oneDNN's linear on a prepacked weight ([packed] or
// [packed, bias]), called at the row counts kernels/cpu/linear.py's onednn_rows pads to.
enum Kind : int64_t {
  kQ4 = 0, kQ8 = 1, kSmall = 2, kDense = 3, kOneDNN = 4, kStrips = 5, kInt8Pack = 6,
  kTile = 7, kQ4Packed = 8, kQ8Packed = 9, kTileInt8 = 10,
  kTileF32 = 11
};

// kernels/cpu/linear.py's onednn_rows: exact up to 16 rows, above that rounded up to 1/8 of
// the power of two below, so that oneDNN's primitive cache sees a bounded set of shapes.
int64_t onednn_rows(int64_t rows) {
  if (rows <= 16) return rows;
  int bits = 0;
  for (int64_t r = rows - 1; r > 0; r >>= 1) ++bits;
  const int64_t step = int64_t{1} << (bits - 4);
  return (rows + step - 1) / step * step;
}

struct Proj {
  int64_t kind;
  std::vector<Tensor> args;
};

// The operators' registered signatures (tensors by value, as their C++ functions take them).
using Q4Op = Tensor(Tensor, Tensor, Tensor, Tensor, Tensor);
using Q8Op = Tensor(Tensor, Tensor, Tensor, Tensor);
using TileOp = Tensor(Tensor, Tensor, Tensor);
using PrefillOp = Tensor(Tensor, Tensor, Tensor, Tensor, int64_t, double);
using DecodeOp = Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, double);

c10::TypedOperatorHandle<Q8Op> op4(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Q8Op>();
}

// The small ops per activation dtype. fp32: one pass each, as the C++ layer ops do. Not
// inlined: the per-call path and the team path run one compiled body of each, so that their
// results are bit-identical (-ffast-math lets two inlined copies fuse or order differently).
// bf16: rounded to bf16 where the module forward's torch ops round (each op's result), so
// that a bf16 step matches it as closely as fp32 does: residual + x; the norm computed in
// fp32, rounded, then times the bf16 weight; RoPE's two products and their sum; SiLU, then
// times up.
template <typename T>
struct Ops;

template <>
struct Ops<float> {
  __attribute__((noinline)) static void norm(float* x, float* residual, const float* w, float* y, int64_t rows,
                   int64_t n, double eps) {
    tl_rows::norm_rows(x, residual, w, y, rows, n, eps);
  }
  // Rotate-half RoPE of one head in place: x[j] * cos[j] -/+ x[j +/- half] * sin[j].
  __attribute__((noinline)) static void rope(float* x, const float* cos, const float* sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; ++j) {
      const float a = x[j], b = x[j + half];
      x[j] = a * cos[j] + (-b) * sin[j];
      x[j + half] = b * cos[j + half] + a * sin[j + half];
    }
  }
  __attribute__((noinline)) static void silu_mul(const float* g, float* y, int64_t rows, int64_t inter) {
    tl_rows::silu_mul_rows(g, y, rows, inter);
  }
};

using bf16 = c10::BFloat16;

template <>
struct Ops<bf16> {
  __attribute__((noinline)) static void norm(bf16* x, bf16* residual, const bf16* w, bf16* y, int64_t rows, int64_t n,
                   double eps) {
    for (int64_t r = 0; r < rows; ++r) {
      bf16* src = x + r * n;
      if (residual != nullptr) {
        bf16* rr = residual + r * n;
        for (int64_t j = 0; j < n; ++j) rr[j] = bf16(float(rr[j]) + float(src[j]));
        src = rr;
      }
      float ss = 0.f;
      for (int64_t j = 0; j < n; ++j) ss += float(src[j]) * float(src[j]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      bf16* yr = y + r * n;
      for (int64_t j = 0; j < n; ++j) yr[j] = bf16(float(w[j]) * float(bf16(float(src[j]) * inv)));
    }
  }
  __attribute__((noinline)) static void rope(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; ++j) {
      const float a = x[j], b = x[j + half];
      x[j] = bf16(float(bf16(a * float(cos[j]))) + float(bf16(-b * float(sin[j]))));
      x[j + half] = bf16(float(bf16(b * float(cos[j + half]))) +
                         float(bf16(a * float(sin[j + half]))));
    }
  }
  __attribute__((noinline)) static void silu_mul(const bf16* g, bf16* y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; ++r) {
      const bf16* gr = g + r * 2 * inter;
      const bf16* ur = gr + inter;
      bf16* yr = y + r * inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float v = gr[j];
        yr[j] = bf16(float(bf16(v / (1.f + std::exp(-v)))) * float(ur[j]));
      }
    }
  }
};

class DecodeStack {
 public:
  DecodeStack(std::vector<Tensor> norms, std::vector<int64_t> kinds,
              std::vector<std::vector<Tensor>> args, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double scale)
      : norms_(std::move(norms)), H_(heads), KVH_(kv_heads), D_(head_dim), RD_(head_dim),
        eps_(eps),
        scale_(scale) {
    TORCH_CHECK(kinds.size() == args.size() && kinds.size() % 4 == 0 &&
                    norms_.size() * 2 == kinds.size(),
                "decode_stack: 4 projections and 2 norms per layer");
    for (size_t i = 0; i < kinds.size(); ++i) {
      TORCH_CHECK(kinds[i] >= kQ4 && kinds[i] <= kTileF32, "decode_stack: unknown kind");
      projs_.push_back(Proj{kinds[i], std::move(args[i])});
      need(kinds[i]);
    }
    for (auto& n : norms_) TORCH_CHECK(n.is_contiguous(), "decode_stack: norm weights");
  }

  int64_t num_layers() const { return static_cast<int64_t>(norms_.size() / 2); }

  // Partial rotary (Phi-4-mini): only the first `rotary_dim` dimensions of each head rotate,
  // from cos / sin rows of that width; the rest pass through.
  void set_rotary_dim(int64_t rd) {
    TORCH_CHECK(rd > 0 && rd <= D_ && rd % 2 == 0, "decode_stack: rotary_dim in (0, head_dim]");
    RD_ = rd;
  }

  // Qwen3's per-head RMSNorm of q and k before RoPE: [q_norm, k_norm] per layer, each of
  // head_dim weights in the norms' dtype (empty: the model has none).
  void set_qk_norms(std::vector<Tensor> qk) {
    TORCH_CHECK(qk.empty() || qk.size() == norms_.size(), "decode_stack: 2 q/k norms a layer");
    for (auto& n : qk)
      TORCH_CHECK(n.is_contiguous() && n.numel() == D_ &&
                      n.scalar_type() == norms_[0].scalar_type(),
                  "decode_stack: q/k norm weights of head_dim in the norms' dtype");
    qk_norms_ = std::move(qk);
  }
  int64_t team_steps() const { return team_steps_.load(std::memory_order_relaxed); }

  // Take the team path (team.h) where it applies: every projection packed q4 / q8 blocks
  // (block_gemm, fp32 activations), rows of fp32, bf16 or int8 (small_gemm,
  // small_gemm_strips) or the tile kernels' FMA body (tile_gemm_f32, tile_gemm, including
  // over a q4 / q8 model's bf16 copy, tile_gemm_int8) of the model's shapes. The arguments:
  // the kernel modules' team_factory() capsules (None: a module not built). Returns whether
  // it will be used; a step whose kernels have no team body at its activations' dtype still
  // takes the per-call path.
  bool enable_team(pybind11::object block, pybind11::object small, pybind11::object tile,
                   pybind11::object attention) {
    team_ = false;
    auto factory = [](pybind11::object o, const char* name) -> void* {
      if (o.is_none()) return nullptr;
      auto c = o.cast<pybind11::capsule>();
      return std::string(c.name()) == name ? c.get_pointer() : nullptr;
    };
    make_[0] = reinterpret_cast<tl_team::MakeProjection>(factory(block, tl_team::kBlockCapsule));
    make_[1] = reinterpret_cast<tl_team::MakeProjection>(factory(small, tl_team::kSmallCapsule));
    make_[2] = reinterpret_cast<tl_team::MakeProjection>(factory(tile, tl_team::kTileCapsule));
    make_attention_ = reinterpret_cast<tl_team::MakeDecodeAttention>(
        factory(attention, tl_team::kAttentionCapsule));
    if (make_attention_ == nullptr) return false;
    const int64_t E = norms_[0].numel(), Q = H_ * D_, KV = KVH_ * D_;
    const bool bf16_act = norms_[0].scalar_type() == at::kBFloat16;
    weights_.clear();
    team_kinds_.clear();
    team_elems_.clear();
    biases_.clear();
    int64_t inter = -1;
    auto panels = [](const Tensor& t, at::ScalarType dt) {
      return t.dim() == 3 && t.is_contiguous() && t.size(2) == 16 && t.scalar_type() == dt;
    };
    auto fp32_vector = [](const Tensor& t, int64_t n) {
      return t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n;
    };
    for (size_t i = 0; i < projs_.size(); ++i) {
      const auto& p = projs_[i];
      const auto& a = p.args;
      int kind, elem = tl_team::kElemF32;
      int64_t n, k;
      tl_team::Weights w{};
      if (p.kind == kQ4Packed || p.kind == kQ8Packed) {
        const bool q4 = p.kind == kQ4Packed;
        kind = q4 ? tl_team::kQ4Packed : tl_team::kQ8Packed;
        if (!a[0].is_contiguous() || !a[1].is_contiguous() || (q4 && !a[2].is_contiguous()))
          return false;
        n = a[0].size(0);
        k = q4 ? a[0].size(1) * 2 : a[0].size(1);
        if (a[1].size(1) * 32 != k) return false;
        w = {a[0].data_ptr(), a[1].data_ptr(), q4 ? a[2].data_ptr() : nullptr, nullptr, n};
      } else if ((p.kind == kSmall || p.kind == kStrips) && a[0].dim() == 2 &&
                 a[0].is_contiguous()) {
        kind = p.kind == kSmall ? tl_team::kSmallRows : tl_team::kSmallStrips;
        n = a[0].size(0);
        k = a[0].size(1);
        const auto wt = a[0].scalar_type();
        if (wt == at::kFloat || wt == at::kBFloat16) {
          if (a[1].numel() != 0) return false;
          elem = wt == at::kFloat ? tl_team::kElemF32 : tl_team::kElemBf16;
          w = {a[0].data_ptr(), nullptr, nullptr, nullptr, n};
        } else if (wt == at::kChar && fp32_vector(a[1], n)) {
          elem = tl_team::kElemInt8;
          w = {a[0].data_ptr(), a[1].data_ptr(), nullptr, nullptr, n};
        } else {
          return false;
        }
      } else if ((p.kind == kTile && panels(a[0], at::kShort)) ||
                 (p.kind == kTileF32 && panels(a[0], at::kFloat))) {
        kind = p.kind == kTile ? tl_team::kTileBf16 : tl_team::kTileF32;
        n = a[0].size(0) * 16;
        k = a[0].size(1);
        w = {a[0].data_ptr(), nullptr, nullptr, nullptr, n};
      } else if (p.kind == kTileInt8 && panels(a[0], at::kChar) &&
                 fp32_vector(a[1], a[0].size(0) * 16)) {
        kind = tl_team::kTileInt8;
        n = a[0].size(0) * 16;
        k = a[0].size(1);
        w = {a[0].data_ptr(), a[1].data_ptr(), nullptr, nullptr, n};
      } else {
        return false;
      }
      const Tensor& bias = a.back();
      if (bias.numel() > 0) {   // in fp32, as every kernel widens it per call
        if (bias.numel() != n) return false;
        biases_.push_back(bias.to(at::kFloat).contiguous());
        w.bias = biases_.back().data_ptr<float>();
      }
      // The module must be there and serve this kind at these activations with the body
      // the operator takes (a vdpbf16ps build's bf16 tiles: not).
      const auto make = make_[tl_team::module_of(kind)];
      if (make == nullptr) return false;
      std::unique_ptr<tl_team::Projection> probe(make(kind, elem, 1, k, bf16_act));
      if (!probe) return false;
      if (i % 4 == 2) {
        if (inter < 0) inter = n / 2;
        if (n != 2 * inter) return false;
      }
      const int64_t want_n[4] = {Q + 2 * KV, E, 2 * inter, E};
      const int64_t want_k[4] = {E, Q, E, inter};
      if (n != want_n[i % 4] || k != want_k[i % 4]) return false;
      weights_.push_back(w);
      team_kinds_.push_back(kind);
      team_elems_.push_back(elem);
    }
    team_ = true;
    return team_;
  }

  // h: [B, E] embeddings (fp32 or bf16, not modified); cos, sin: [B, rotary_dim]; pool: the KV
  // pool [L, 2, blocks, block_size, KVH, D] (h's dtype, contiguous); slots [B]; the
  // decode rows (the first lens.size(0) rows): tables [nd, nb], lens [nd] (int64);
  // prefill chunks after them: segs [S, 3] (query_start, query_len, start_pos) with a
  // block table each (seg_tables). Returns the residual stream after the last layer, [B, E].
  Tensor run(const Tensor& h, const Tensor& cos, const Tensor& sin, const Tensor& pool,
             const Tensor& slots, const Tensor& tables, const Tensor& lens,
             const Tensor& segs, const std::vector<Tensor>& seg_tables) {
    TORCH_CHECK(h.dim() == 2, "decode_stack: h must be [rows, hidden]");
    TORCH_CHECK(segs.dim() == 2 && segs.size(1) == 3 && segs.scalar_type() == at::kLong &&
                    segs.size(0) == static_cast<int64_t>(seg_tables.size()),
                "decode_stack: segs [S, 3] int64 with a block table each");
    if (segs.size(0) > 0 && !prefill_) {
      prefill_ = c10::Dispatcher::singleton()
                     .findSchemaOrThrow("tokenloom::prefill_attention_paged_cpu", "")
                     .typed<PrefillOp>();
    }
    // The pool holds the activations' dtype, or bf16 / fp16 under fp32 activations
    // (cache.kv_dtype bf16 / fp16): K and V are rounded as they are stored.
    const auto pt = pool.scalar_type();
    if (h.scalar_type() == at::kFloat) {
      if (pt == at::kBFloat16)
        return run_t<float, bf16>(h, cos, sin, pool, slots, tables, lens, segs, seg_tables);
      if (pt == at::kHalf)
        return run_t<float, c10::Half>(h, cos, sin, pool, slots, tables, lens, segs,
                                       seg_tables);
      return run_t<float, float>(h, cos, sin, pool, slots, tables, lens, segs, seg_tables);
    }
    TORCH_CHECK(h.scalar_type() == at::kBFloat16, "decode_stack: fp32 or bf16 activations");
    return run_t<bf16, bf16>(h, cos, sin, pool, slots, tables, lens, segs, seg_tables);
  }

 private:
  template <typename T, typename C>
  Tensor run_t(const Tensor& h_in, const Tensor& cos, const Tensor& sin, const Tensor& pool,
               const Tensor& slots, const Tensor& tables, const Tensor& lens,
               const Tensor& segs_in, const std::vector<Tensor>& seg_tables) const {
    const auto dtype = h_in.scalar_type();
    TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() &&
                    pool.scalar_type() == c10::CppTypeToScalarType<C>::value &&
                    pool.size(0) == num_layers() && pool.size(4) == KVH_ && pool.size(5) == D_,
                "decode_stack: the pool must be [layers, 2, blocks, block_size, KVH, D] in "
                "the activations' dtype (or bf16 / fp16 under fp32 activations)");
    for (auto& n : norms_) TORCH_CHECK(n.scalar_type() == dtype, "decode_stack: norm dtype");
    const int64_t B = h_in.size(0), E = h_in.size(1), Q = H_ * D_, KV = KVH_ * D_;
    const int64_t BS = pool.size(3), slots_per_layer = pool.size(2) * BS;
    Tensor h = h_in.contiguous().clone();
    Tensor cs = cos.to(dtype).contiguous(), sn = sin.to(dtype).contiguous();
    Tensor sl = slots.contiguous();
    TORCH_CHECK(cs.numel() == B * RD_ && sn.numel() == B * RD_ && sl.numel() == B,
                "decode_stack: cos, sin (rotary_dim) and slots per row");
    const T* cp = cs.data_ptr<T>();
    const T* sp = sn.data_ptr<T>();
    const int64_t* slot = sl.data_ptr<int64_t>();
    const int64_t nd = lens.size(0), S = segs_in.size(0);
    Tensor segs = segs_in.contiguous();
    const int64_t* seg = segs.data_ptr<int64_t>();
    int64_t covered = nd;
    for (int64_t i = 0; i < S; ++i) {
      TORCH_CHECK(seg[3 * i] == covered && seg[3 * i + 1] > 0 && seg[3 * i + 2] >= 0,
                  "decode_stack: prefill chunks follow the decode rows, in order");
      covered += seg[3 * i + 1];
    }
    TORCH_CHECK(covered == B, "decode_stack: decode rows and chunks cover the step's rows");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(slot[b] < slots_per_layer, "decode_stack: slot out of range");
    // Not with more threads than CPUs: a spin barrier waits on descheduled threads.
    static const int cpus = tl_team::usable_cpus();
    const int threads = at::get_num_threads();
    if (S == 0 && team_ && g_team && threads > 1 && threads <= cpus) {
      Tensor out = run_team<T, C>(h, cp, sp, slot, pool, tables, lens);
      if (out.defined()) return out;
    }
    Tensor x = at::empty({B, E}, h.options());
    std::vector<T> krow(KV);   // a key row rotated in the activations' dtype, then stored
    Tensor m;   // the previous layer's MLP output (none before the first)
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Proj* p = &projs_[4 * l];
      if (m.defined()) {
        Ops<T>::norm(m.data_ptr<T>(), h.data_ptr<T>(), norms_[2 * l].data_ptr<T>(),
                     x.data_ptr<T>(), B, E, eps_);
      } else {
        Ops<T>::norm(h.data_ptr<T>(), nullptr, norms_[2 * l].data_ptr<T>(), x.data_ptr<T>(), B,
                     E, eps_);
      }
      Tensor qkv = project(p[0], x);                      // [B, Q + 2 KV]
      TORCH_CHECK(qkv.size(1) == Q + 2 * KV && qkv.scalar_type() == dtype,
                  "decode_stack: qkv width and dtype");
      Tensor q = at::empty({B, H_, D_}, h.options());
      Tensor layer = pool.select(0, l);
      Tensor kc = layer.select(0, 0), vc = layer.select(0, 1);
      C* kp = kc.data_ptr<C>();
      C* vp = vc.data_ptr<C>();
      const T* qkvp = qkv.data_ptr<T>();
      T* qp = q.data_ptr<T>();
      rope_store<T, C>(l, B, qkvp, cp, sp, qp, slot, kp, vp, krow.data());
      Tensor o;
      if (S == 0) {
        o = decode_.call(q, kc, vc, tables, lens, scale_).view({B, Q});
      } else {   // decode rows, then each chunk over its context (read from the pool)
        o = at::empty({B, H_, D_}, h.options());
        if (nd > 0)
          o.narrow(0, 0, nd).copy_(decode_.call(q.narrow(0, 0, nd), kc, vc, tables, lens,
                                                scale_));
        for (int64_t i = 0; i < S; ++i)
          o.narrow(0, seg[3 * i], seg[3 * i + 1])
              .copy_(prefill_->call(q.narrow(0, seg[3 * i], seg[3 * i + 1]), kc, vc,
                                    seg_tables[i], seg[3 * i + 2], scale_));
        o = o.view({B, Q});
      }
      Tensor a = project(p[1], o);
      Ops<T>::norm(a.data_ptr<T>(), h.data_ptr<T>(), norms_[2 * l + 1].data_ptr<T>(),
                   x.data_ptr<T>(), B, E, eps_);
      Tensor gu = project(p[2], x);
      const int64_t inter = gu.size(1) / 2;
      Tensor y = at::empty({B, inter}, h.options());
      Ops<T>::silu_mul(gu.data_ptr<T>(), y.data_ptr<T>(), B, inter);
      m = project(p[3], y);
    }
    if (m.defined()) h.add_(m);
    return h;
  }

  // The team path (team.h): a decode-only step whose projections all have a team kernel
  // (enable_team) runs its layers in one OpenMP parallel region, with the small ops of the
  // per-call path (Ops<T>, the same K/V rounding). h: the step's residual stream (a copy,
  // updated in place and returned); undefined when a kernel has no team body for this step
  // (the caller takes the per-call path).
  template <typename T, typename C>
  Tensor run_team(Tensor h, const T* cp, const T* sp, const int64_t* slot, const Tensor& pool,
                  const Tensor& tables_in, const Tensor& lens_in) const {
    constexpr bool kBf16 = std::is_same_v<T, bf16>;
    const int64_t B = h.size(0), E = h.size(1), Q = H_ * D_, KV = KVH_ * D_;
    const int64_t L = num_layers(), BS = pool.size(3);
    const int64_t layer_stride = pool[0].numel(), side = layer_stride / 2;
    const int64_t slots_per_layer = pool.size(2) * BS;
    Tensor tables = tables_in.contiguous(), lens = lens_in.contiguous();
    TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                    tables.dim() == 2 && tables.size(0) == B && lens.numel() == B,
                "decode_stack: block tables [B, blocks] and lengths [B], int64");
    for (int64_t b = 0; b < B; ++b)   // checked here: nothing may throw inside the region
      TORCH_CHECK(slot[b] < slots_per_layer, "decode_stack: slot out of range");
    const int nt = at::get_num_threads();
    tl_team::AttentionShape shape{kBf16 ? 1 : 0,
                                  std::is_same_v<C, float> ? 0 : std::is_same_v<C, bf16> ? 1 : 2,
                                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), B, H_,
                                  KVH_, D_, BS, tables.size(1), BS * KV, KV,
                                  static_cast<float>(scale_), nt};
    std::unique_ptr<tl_team::DecodeAttention> attn(make_attention_(shape));
    if (!attn) return Tensor();
    // One kernel object (its activation buffers) per projection position and kind.
    const int64_t inter = weights_[2].n / 2;
    const int64_t widths[4] = {E, Q, E, inter};
    std::unique_ptr<tl_team::Projection> calls[4][tl_team::kProjectionKinds];
    for (int64_t i = 0; i < 4 * L; ++i) {
      const int kind = team_kinds_[i];
      auto& c = calls[i % 4][kind];
      if (!c) c.reset(make_[tl_team::module_of(kind)](kind, team_elems_[i], B, widths[i % 4],
                                                       kBf16));
      if (!c) return Tensor();
    }
    auto call = [&](int64_t l, int pos) { return calls[pos][team_kinds_[4 * l + pos]].get(); };
    auto opts = h.options();
    Tensor x = at::empty({B, E}, opts), qkv = at::empty({B, Q + 2 * KV}, opts);
    Tensor q = at::empty({B, Q}, opts), o = at::empty({B, Q}, opts), a = at::empty({B, E}, opts);
    Tensor gu = at::empty({B, 2 * inter}, opts), y = at::empty({B, inter}, opts);
    Tensor m = at::empty({B, E}, opts);
    T *hp = h.data_ptr<T>(), *xp = x.data_ptr<T>(), *qkvp = qkv.data_ptr<T>();
    T *qp = q.data_ptr<T>(), *op = o.data_ptr<T>(), *ap = a.data_ptr<T>();
    T *gup = gu.data_ptr<T>(), *yp = y.data_ptr<T>(), *mp = m.data_ptr<T>();
    C* poolp = reinterpret_cast<C*>(pool.data_ptr());
    std::vector<const T*> norm_w;
    for (auto& n : norms_) norm_w.push_back(n.data_ptr<T>());
    const double eps = eps_;
    std::vector<T> krow(KVH_ * D_);   // rope_store's scratch (one thread at a time uses it)
    // Serial steps between the kernels (run by the last thread to reach each barrier): the
    // per-call path's RoPE and K/V store (run_t), then the attention pointed at the layer.
    auto rope_store_layer = [&](int64_t l) {
      C* kp = poolp + l * layer_stride;
      C* vp = kp + side;
      rope_store<T, C>(l, B, qkvp, cp, sp, qp, slot, kp, vp, krow.data());
      attn->bind(qp, kp, vp, op);
    };
    tl_team::Barrier bar(nt);
    bool short_team = false;
#pragma omp parallel num_threads(nt)
    {
      const int part = omp_get_thread_num(), parts = omp_get_num_threads();
      if (parts != nt) {
        // Fewer threads than asked (a nested region): the barrier would wait forever.
#pragma omp single
        short_team = true;
      } else {
        bar.arrive([&] {
          Ops<T>::norm(hp, nullptr, norm_w[0], xp, B, E, eps);
          call(0, 0)->prepare(xp);
        });
        for (int64_t l = 0; l < L; ++l) {
          const tl_team::Weights* w = &weights_[4 * l];
          call(l, 0)->rows(w[0], qkvp, part, parts);
          bar.arrive([&] { rope_store_layer(l); });
          attn->items(part);
          bar.arrive([&] {
            attn->merge();
            call(l, 1)->prepare(op);
          });
          call(l, 1)->rows(w[1], ap, part, parts);
          bar.arrive([&] {
            Ops<T>::norm(ap, hp, norm_w[2 * l + 1], xp, B, E, eps);
            call(l, 2)->prepare(xp);
          });
          call(l, 2)->rows(w[2], gup, part, parts);
          bar.arrive([&] {
            Ops<T>::silu_mul(gup, yp, B, inter);
            call(l, 3)->prepare(yp);
          });
          call(l, 3)->rows(w[3], mp, part, parts);
          bar.arrive([&] {
            if (l + 1 < L) {
              Ops<T>::norm(mp, hp, norm_w[2 * l + 2], xp, B, E, eps);
              call(l + 1, 0)->prepare(xp);
            } else {   // h + m (bf16: rounded once, as add_ rounds)
              for (int64_t i = 0; i < B * E; ++i) hp[i] = T(float(hp[i]) + float(mp[i]));
            }
          });
        }
      }
    }
    if (short_team) return Tensor();
    team_steps_.fetch_add(1, std::memory_order_relaxed);
    return h;
  }

  void need(int64_t kind) {
    if (kind == kQ4 && !q4_) {
      q4_ = c10::Dispatcher::singleton().findSchemaOrThrow("tokenloom::q4_gemm", "")
                .typed<Q4Op>();
    } else if (kind == kQ8 && !q8_) {
      q8_ = op4("tokenloom::q8_gemm");
    } else if (kind == kQ4Packed && !q4p_) {
      q4p_ = c10::Dispatcher::singleton().findSchemaOrThrow("tokenloom::q4_gemm_packed", "")
                 .typed<Q4Op>();
    } else if (kind == kQ8Packed && !q8p_) {
      q8p_ = op4("tokenloom::q8_gemm_packed");
    } else if (kind == kSmall && !small_) {
      small_ = op4("tokenloom::small_gemm");
    } else if (kind == kStrips && !strips_) {
      strips_ = op4("tokenloom::small_gemm_strips");
    } else if (kind == kTile && !tile_) {
      tile_ = c10::Dispatcher::singleton().findSchemaOrThrow("tokenloom::tile_gemm", "")
                  .typed<TileOp>();
    } else if (kind == kTileInt8 && !tile8_) {
      tile8_ = op4("tokenloom::tile_gemm_int8");
    } else if (kind == kTileF32 && !tile32_) {
      tile32_ = c10::Dispatcher::singleton().findSchemaOrThrow("tokenloom::tile_gemm_f32", "")
                    .typed<TileOp>();
    } else if (kind == kOneDNN && !onednn_) {
      onednn_ = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    }
  }

  // Boxed: the operator's C++ signature (string views, a list of optional scalars) is not
  // part of torch's extension headers; a boxed call costs ~1 us against a projection's
  // tens of microseconds.
  Tensor onednn(const Tensor& x, const std::vector<Tensor>& a) const {
    const int64_t rows = x.size(0), padded = onednn_rows(rows);
    Tensor in = padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows});
    torch::jit::Stack st;
    st.emplace_back(in);
    st.emplace_back(a[0]);
    st.emplace_back(a.size() > 1 ? c10::IValue(a[1]) : c10::IValue());
    st.emplace_back(std::string("none"));
    st.emplace_back(c10::List<c10::optional<at::Scalar>>());
    st.emplace_back(std::string(""));
    onednn_->callBoxed(&st);
    Tensor out = st[0].toTensor();
    return padded == rows ? out : out.narrow(0, 0, rows).contiguous();
  }

  Tensor project(const Proj& p, const Tensor& x) const {
    const auto& a = p.args;
    switch (p.kind) {
      case kQ4: return q4_->call(x, a[0], a[1], a[2], a[3]);
      case kQ8: return q8_->call(x, a[0], a[1], a[2]);
      case kQ4Packed: return q4p_->call(x, a[0], a[1], a[2], a[3]);
      case kQ8Packed: return q8p_->call(x, a[0], a[1], a[2]);
      case kSmall: return small_->call(x, a[0], a[1], a[2]);
      case kStrips: return strips_->call(x, a[0], a[1], a[2]);
      case kOneDNN: return onednn(x, a);
      case kTile: return tile_->call(x, a[0], a[1]);   // [packed panels, bias or empty]
      case kTileInt8: return tile8_->call(x, a[0], a[1], a[2]);   // [panels, scales, bias]
      case kTileF32: return tile32_->call(x, a[0], a[1]);   // [panels, bias or empty]
      case kInt8Pack: {   // torch's int8 matmul: [q, bf16 scales, bias or empty]
        Tensor y = at::_weight_int8pack_mm(x.to(at::kBFloat16).contiguous(), a[0], a[1])
                       .to(x.scalar_type());
        return a[2].numel() > 0 ? y.add_(a[2]) : y;
      }
      default: return at::linear(x, a[0], a.size() > 1 ? c10::optional<Tensor>(a[1])
                                                         : c10::nullopt);
    }
  }

  // Between layer l's qkv projection and its attention, on both paths: each row's q
  // (q/k-normed where the model has the norms, then rotated) into qp, its k (the same) and
  // v stored at the row's slot in the layer's pool kp / vp (slot < 0: not stored; slots
  // checked by run_t). krow: scratch for a key row in T when the pool's dtype differs.
  template <typename T, typename C>
  void rope_store(int64_t l, int64_t B, const T* qkvp, const T* cp, const T* sp, T* qp,
                  const int64_t* slot, C* kp, C* vp, T* krow) const {
    const int64_t Q = H_ * D_, KV = KVH_ * D_;
    for (int64_t b = 0; b < B; ++b) {
      const T* row = qkvp + b * (Q + 2 * KV);
      const T* c = cp + b * RD_;
      const T* s = sp + b * RD_;
      T* qb = qp + b * Q;
      std::copy(row, row + Q, qb);
      head_norms(qb, H_, l, 0);
      for (int64_t hh = 0; hh < H_; ++hh) Ops<T>::rope(qb + hh * D_, c, s, RD_);
      if (slot[b] < 0) continue;
      C* kd = kp + slot[b] * KV;
      if constexpr (std::is_same_v<T, C>) {   // rotated in place in the pool
        std::copy(row + Q, row + Q + KV, kd);
        head_norms(kd, KVH_, l, 1);
        for (int64_t hh = 0; hh < KVH_; ++hh) Ops<T>::rope(kd + hh * D_, c, s, RD_);
      } else {   // rotated in T, then rounded to the pool's dtype (as store_kv rounds)
        std::copy(row + Q, row + Q + KV, krow);
        head_norms(krow, KVH_, l, 1);
        for (int64_t hh = 0; hh < KVH_; ++hh) Ops<T>::rope(krow + hh * D_, c, s, RD_);
        for (int64_t i = 0; i < KV; ++i) kd[i] = tl_rows::to_pool<C>(krow[i]);
      }
      const T* vsrc = row + Q + KV;
      C* vd = vp + slot[b] * KV;
      for (int64_t i = 0; i < KV; ++i) vd[i] = tl_rows::to_pool<C>(vsrc[i]);
    }
  }

  // Each of `heads` heads of x normalized in place by weights w (the module's RMSNorm over
  // head_dim), before RoPE rotates it.
  template <typename T>
  void head_norms(T* x, int64_t heads, int64_t l, int which) const {
    if (qk_norms_.empty()) return;
    const T* w = qk_norms_[2 * l + which].data_ptr<T>();
    for (int64_t hh = 0; hh < heads; ++hh)
      Ops<T>::norm(x + hh * D_, nullptr, w, x + hh * D_, 1, D_, eps_);
  }

  std::vector<Tensor> norms_;
  std::vector<Tensor> qk_norms_;   // [q_norm, k_norm] per layer, or empty
  std::vector<Proj> projs_;
  bool team_ = false;
  tl_team::MakeProjection make_[3] = {nullptr, nullptr, nullptr};   // by tl_team::module_of
  tl_team::MakeDecodeAttention make_attention_ = nullptr;
  std::vector<tl_team::Weights> weights_;   // the projections' weights (team path)
  std::vector<int> team_kinds_;             // and their tl_team::ProjectionKind,
  std::vector<int> team_elems_;             // tl_team::WeightElem
  std::vector<Tensor> biases_;              // fp32 copies the weights' bias pointers read
  mutable std::atomic<int64_t> team_steps_{0};    // steps the team path served
  int64_t H_, KVH_, D_;
  int64_t RD_;   // the rotating dimensions of a head (head_dim unless partial)
  double eps_, scale_;
  c10::optional<c10::TypedOperatorHandle<Q4Op>> q4_, q4p_;
  c10::optional<c10::TypedOperatorHandle<Q8Op>> q8_, q8p_, small_, strips_, tile8_;
  c10::optional<c10::TypedOperatorHandle<TileOp>> tile_, tile32_;
  c10::optional<c10::TypedOperatorHandle<PrefillOp>> prefill_;
  c10::optional<c10::OperatorHandle> onednn_;
  c10::TypedOperatorHandle<DecodeOp> decode_ = c10::Dispatcher::singleton()
      .findSchemaOrThrow("tokenloom::paged_decode_cpu", "").typed<DecodeOp>();
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("use_team", [](bool on) { g_team = on; },
          "false: every step takes the per-call path (for tests and measurements)");
  pybind11::class_<DecodeStack>(mod, "DecodeStack")
      .def(pybind11::init<std::vector<Tensor>, std::vector<int64_t>,
                          std::vector<std::vector<Tensor>>, int64_t, int64_t, int64_t, double,
                          double>())
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_rotary_dim", &DecodeStack::set_rotary_dim,
           "rotate only the first rotary_dim dimensions of each head (partial rotary)")
      .def("set_qk_norms", &DecodeStack::set_qk_norms,
           "per-head q and k RMSNorm weights, two a layer (Qwen3), applied before RoPE")
      .def("team_steps", &DecodeStack::team_steps, "steps served by one OpenMP team")
      .def("enable_team", &DecodeStack::enable_team,
           "run decode-only steps in one OpenMP team where the kernels allow (team.h)")
      .def("run", &DecodeStack::run, "the decoder layers of one step",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
