// A whole decode step's decoder layers in one call from Python (fp32 activations, CPU).
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
//   q, k, v = x . Wqkv^T (+ b); q, k rotated (rotate-half RoPE from the cos/sin rows)
//   k, v written into the layer's cache at the row's slot (slot < 0: not written)
//   o = attention(q, cache) . Wo^T;  h += o;  x = rmsnorm(h) * w2
//   m = (silu(gate) * up)(x . Wgu^T) . Wdown^T
// and returns h + m. The RoPE products may round differently in the last bit (the compiler
// may fuse a multiply and add); everything else is bit-identical.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "row_ops.h"

namespace {

using at::Tensor;

// How a projection runs (kernels/cpu/linear.py's kernel names): the operator and its
// tensor arguments after x.
enum Kind : int64_t { kQ4 = 0, kQ8 = 1, kSmall = 2, kDense = 3 };

struct Proj {
  int64_t kind;
  std::vector<Tensor> args;
};

// The operators' registered signatures (tensors by value, as their C++ functions take them).
using Q4Op = Tensor(Tensor, Tensor, Tensor, Tensor, Tensor);
using Q8Op = Tensor(Tensor, Tensor, Tensor, Tensor);
using DecodeOp = Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, double);

c10::TypedOperatorHandle<Q8Op> op4(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Q8Op>();
}

// Rotate-half RoPE of one head in place: x[j] * cos[j] -/+ x[j +/- half] * sin[j].
inline void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * cos[j] + (-b) * sin[j];
    x[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

class DecodeStack {
 public:
  DecodeStack(std::vector<Tensor> norms, std::vector<int64_t> kinds,
              std::vector<std::vector<Tensor>> args, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double scale)
      : norms_(std::move(norms)), H_(heads), KVH_(kv_heads), D_(head_dim), eps_(eps),
        scale_(scale) {
    TORCH_CHECK(kinds.size() == args.size() && kinds.size() % 4 == 0 &&
                    norms_.size() * 2 == kinds.size(),
                "decode_stack: 4 projections and 2 norms per layer");
    for (size_t i = 0; i < kinds.size(); ++i) {
      TORCH_CHECK(kinds[i] >= kQ4 && kinds[i] <= kDense, "decode_stack: unknown kind");
      projs_.push_back(Proj{kinds[i], std::move(args[i])});
      need(kinds[i]);
    }
    for (auto& n : norms_) TORCH_CHECK(n.is_contiguous() && n.scalar_type() == at::kFloat,
                                       "decode_stack: fp32 norm weights");
  }

  int64_t num_layers() const { return static_cast<int64_t>(norms_.size() / 2); }

  // h: [B, E] embeddings (fp32, not modified); cos, sin: [B, D]; pool: the KV pool
  // [L, 2, blocks, block_size, KVH, D] (fp32, contiguous); slots [B], tables [B, nb],
  // lens [B] (int64). Returns the residual stream after the last layer, [B, E].
  Tensor run(const Tensor& h_in, const Tensor& cos, const Tensor& sin, const Tensor& pool,
             const Tensor& slots, const Tensor& tables, const Tensor& lens) const {
    TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat, "decode_stack: h");
    TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() && pool.scalar_type() == at::kFloat &&
                    pool.size(0) == num_layers() && pool.size(4) == KVH_ && pool.size(5) == D_,
                "decode_stack: the pool must be fp32 [layers, 2, blocks, block_size, KVH, D]");
    const int64_t B = h_in.size(0), E = h_in.size(1), Q = H_ * D_, KV = KVH_ * D_;
    const int64_t BS = pool.size(3), slots_per_layer = pool.size(2) * BS;
    Tensor h = h_in.contiguous().clone();
    Tensor cs = cos.contiguous(), sn = sin.contiguous(), sl = slots.contiguous();
    TORCH_CHECK(cs.numel() == B * D_ && sn.numel() == B * D_ && sl.numel() == B,
                "decode_stack: cos, sin and slots per row");
    const float* cp = cs.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    const int64_t* slot = sl.data_ptr<int64_t>();
    Tensor x = at::empty({B, E}, h.options());
    Tensor m;   // the previous layer's MLP output (none before the first)
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Proj* p = &projs_[4 * l];
      if (m.defined()) {
        tl_rows::norm_rows(m.data_ptr<float>(), h.data_ptr<float>(),
                           norms_[2 * l].data_ptr<float>(), x.data_ptr<float>(), B, E, eps_);
      } else {
        tl_rows::norm_rows(h.data_ptr<float>(), nullptr, norms_[2 * l].data_ptr<float>(),
                           x.data_ptr<float>(), B, E, eps_);
      }
      Tensor qkv = project(p[0], x);                      // [B, Q + 2 KV]
      TORCH_CHECK(qkv.size(1) == Q + 2 * KV, "decode_stack: qkv width");
      Tensor q = at::empty({B, H_, D_}, h.options());
      Tensor layer = pool.select(0, l);
      Tensor kc = layer.select(0, 0), vc = layer.select(0, 1);
      float* kp = kc.data_ptr<float>();
      float* vp = vc.data_ptr<float>();
      const float* qkvp = qkv.data_ptr<float>();
      float* qp = q.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        const float* row = qkvp + b * (Q + 2 * KV);
        const float* c = cp + b * D_;
        const float* s = sp + b * D_;
        float* qb = qp + b * Q;
        std::copy(row, row + Q, qb);
        for (int64_t hh = 0; hh < H_; ++hh) rope_head(qb + hh * D_, c, s, D_);
        if (slot[b] < 0) continue;
        TORCH_CHECK(slot[b] < slots_per_layer, "decode_stack: slot out of range");
        float* kd = kp + slot[b] * KV;
        std::copy(row + Q, row + Q + KV, kd);
        for (int64_t hh = 0; hh < KVH_; ++hh) rope_head(kd + hh * D_, c, s, D_);
        std::copy(row + Q + KV, row + Q + 2 * KV, vp + slot[b] * KV);
      }
      Tensor o = decode_.call(q, kc, vc, tables, lens, scale_).view({B, Q});
      Tensor a = project(p[1], o);
      tl_rows::norm_rows(a.data_ptr<float>(), h.data_ptr<float>(),
                         norms_[2 * l + 1].data_ptr<float>(), x.data_ptr<float>(), B, E, eps_);
      Tensor gu = project(p[2], x);
      const int64_t inter = gu.size(1) / 2;
      Tensor y = at::empty({B, inter}, h.options());
      tl_rows::silu_mul_rows(gu.data_ptr<float>(), y.data_ptr<float>(), B, inter);
      m = project(p[3], y);
    }
    if (m.defined()) h.add_(m);
    return h;
  }

 private:
  void need(int64_t kind) {
    if (kind == kQ4 && !q4_) {
      q4_ = c10::Dispatcher::singleton().findSchemaOrThrow("tokenloom::q4_gemm", "")
                .typed<Q4Op>();
    } else if (kind == kQ8 && !q8_) {
      q8_ = op4("tokenloom::q8_gemm");
    } else if (kind == kSmall && !small_) {
      small_ = op4("tokenloom::small_gemm");
    }
  }

  Tensor project(const Proj& p, const Tensor& x) const {
    const auto& a = p.args;
    switch (p.kind) {
      case kQ4: return q4_->call(x, a[0], a[1], a[2], a[3]);
      case kQ8: return q8_->call(x, a[0], a[1], a[2]);
      case kSmall: return small_->call(x, a[0], a[1], a[2]);
      default: return at::linear(x, a[0], a.size() > 1 ? c10::optional<Tensor>(a[1])
                                                         : c10::nullopt);
    }
  }

  std::vector<Tensor> norms_;
  std::vector<Proj> projs_;
  int64_t H_, KVH_, D_;
  double eps_, scale_;
  c10::optional<c10::TypedOperatorHandle<Q4Op>> q4_;
  c10::optional<c10::TypedOperatorHandle<Q8Op>> q8_, small_;
  c10::TypedOperatorHandle<DecodeOp> decode_ = c10::Dispatcher::singleton()
      .findSchemaOrThrow("tokenloom::paged_decode_cpu", "").typed<DecodeOp>();
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  pybind11::class_<DecodeStack>(mod, "DecodeStack")
      .def(pybind11::init<std::vector<Tensor>, std::vector<int64_t>,
                          std::vector<std::vector<Tensor>>, int64_t, int64_t, int64_t, double,
                          double>())
      .def("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run, "the decoder layers of one decode step",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
