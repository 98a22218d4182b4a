// A decode step's products on the CPU: MLX's CPU matmul is one cblas_sgemm whatever the
// shape, and OpenBLAS (0.3.21, Debian's) packs the whole weight matrix into its panel layout
// on every call, also for one row: 44% of a SmolLM2 decode step was that copy
// (sgemm_incopy). A matrix-vector product per row reads the weights once and packs nothing:
// 2.8x (the 49,152-row output layer) to 5.6x (the MLP's) faster at one row, still ahead at
// four, behind from eight (bench/cpu-gemv.cc; bench/cpu-decode.sh measures the whole step).
// So x @ W.T for a few rows is that product here, with the BLAS MLX uses; a row's result
// does not depend on how many rows came with it (batch and solo decode agree bit for bit up
// to kFewRows rows).
#include "mlx/cpp/cpu_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/cpp/cpu_blas.h"
#include "mlx/cpp/cpu_qmatmul.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlx_shim {
namespace {

// `a`'s elements in row-major order: its own memory where it is already so, else a copy.
const float* row_major(const mx::array& a, std::vector<float>& copy) {
  if (a.flags().row_contiguous) return a.data<float>();
  copy.resize(a.size());
  const float* base = a.data<float>();
  for (size_t i = 0; i < a.size(); i++) copy[i] = base[mx::elem_to_loc(static_cast<int>(i), a)];
  return copy.data();
}

class FewRowsMatmul : public mx::UnaryPrimitive {
 public:
  FewRowsMatmul(mx::Stream stream, float alpha, float beta) : mx::UnaryPrimitive(stream), alpha_(alpha), beta_(beta) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& b = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    std::optional<mx::array> c;
    if (inputs.size() == 3) c = inputs[2];
    encoder.dispatch([x, b, c, y = out.data<float>(), alpha = alpha_, beta = beta_]() {
      const int k = b.shape(0), n = b.shape(1);
      const int rows = static_cast<int>(x.size() / k);
      std::vector<float> x_copy, b_copy, c_copy;
      const float* xs = row_major(x, x_copy);
      // b [K, N] is most often W.T of a row-major W [N, K]: then y = W x, W read as it lies.
      int trans = blas::kNoTrans, lda = k;
      const float* w;
      if (b.flags().col_contiguous) {
        w = b.data<float>();
      } else {
        w = row_major(b, b_copy);
        trans = blas::kTrans;
        lda = n;
      }
      const float* bias = c ? row_major(*c, c_copy) : nullptr;
      const blas::Sgemv gemv = blas::sgemv();
      for (int r = 0; r < rows; r++) {
        float* out_row = y + static_cast<size_t>(r) * n;
        if (bias) std::memcpy(out_row, bias, sizeof(float) * n);
        const int m = trans == blas::kNoTrans ? n : k, cols = trans == blas::kNoTrans ? k : n;
        gemv(blas::kRowMajor, trans, m, cols, alpha, w, lda, xs + static_cast<size_t>(r) * k, 1, bias ? beta : 0.f,
             out_row, 1);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's few-rows matmul has no GPU version");
  }

  const char* name() const override { return "HostFewRowsMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const FewRowsMatmul*>(&other);
    return o != nullptr && o->alpha_ == alpha_ && o->beta_ == beta_;
  }

 private:
  float alpha_, beta_;
};

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_CPU_GEMV");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

// ---- Batched products over the host's threads ---------------------------------------------
// One operand of a batched product as MLX's CPU matmul takes it: transposed or not with its
// leading dimension read from the last two strides, else copied row-major first.
struct Operand {
  const float* data;
  mx::Shape shape;
  mx::Strides strides;
  bool transposed;
  int ld;
  std::vector<float> copy;

  explicit Operand(const mx::array& a) : data(a.data<float>()), shape(a.shape()), strides(a.strides()) {
    const auto rows = strides[a.ndim() - 2], cols = strides[a.ndim() - 1];
    if (rows == a.shape(-1) && cols == 1) {
      transposed = false;
      ld = static_cast<int>(rows);
    } else if (rows == 1 && cols == a.shape(-2)) {
      transposed = true;
      ld = static_cast<int>(cols);
    } else {
      data = row_major(a, copy);
      strides = mx::Strides(shape.size(), 1);
      for (int i = static_cast<int>(shape.size()) - 2; i >= 0; i--) strides[i] = strides[i + 1] * shape[i + 1];
      transposed = false;
      ld = a.shape(-1);
    }
  }

  const float* matrix(size_t first) const { return data + mx::elem_to_loc(static_cast<int>(first), shape, strides); }
};

class BatchedMatmul : public mx::UnaryPrimitive {
 public:
  explicit BatchedMatmul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([a = inputs[0], b = inputs[1], y = out.data<float>(), n_out = out.shape(-1), size = out.size()]() {
      const int m = a.shape(-2), n = b.shape(-1), k = a.shape(-1);
      if (k == 0) {
        std::fill(y, y + size, 0.f);
        return;
      }
      const Operand x(a), w(b);
      const size_t batch = a.size() / (static_cast<size_t>(m) * k);
      const int tasks = static_cast<int>(std::min<size_t>(batch, static_cast<size_t>(cpu_threads()) * 4));
      const size_t per = (batch + tasks - 1) / tasks;
      const blas::Sgemm gemm = blas::sgemm();
      cpu_parallel_for(tasks, [&](int t) {
        const size_t end = std::min(batch, (t + 1) * per);
        for (size_t i = t * per; i < end; i++) {
          gemm(blas::kRowMajor, x.transposed ? blas::kTrans : blas::kNoTrans,
               w.transposed ? blas::kTrans : blas::kNoTrans, m, n, k, 1.f, x.matrix(static_cast<size_t>(m) * k * i),
               x.ld, w.matrix(static_cast<size_t>(k) * n * i), w.ld, 0.f, y + static_cast<size_t>(m) * n * i, n_out);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's batched matmul has no GPU version");
  }

  const char* name() const override { return "HostBatchedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const BatchedMatmul*>(&other) != nullptr;
  }
};

bool batched_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_CPU_BATCH_MATMUL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

// A product is shared out where the batch's work is over ~10 microseconds (64k multiply-adds)
// and each matrix's stays where OpenBLAS runs it on the calling thread (its threads start at
// 4 x 65,536 multiply-adds a call): two callers at once would otherwise queue for them.
constexpr size_t kShareFrom = size_t{1} << 16, kEachUpTo = size_t{1} << 18;

}  // namespace

std::optional<mx::array> cpu_batched_matmul(const mx::array& a, const mx::array& b) {
  // Also on one thread (the same products in the same order as MLX's): so the tests, which
  // run with one, check this primitive's products against MLX's bit for bit.
  if (!batched_enabled() || mx::default_device() != mx::Device::cpu || blas::sgemm() == nullptr) return std::nullopt;
  if (a.dtype() != mx::float32 || b.dtype() != mx::float32 || (a.ndim() < 3 && b.ndim() < 3)) return std::nullopt;
  // MLX's own op, lazily: its node's inputs are the operands as its primitive gets them
  // (batch axes broadcast, vectors made matrices), so the products below are its products.
  auto ref = mx::matmul(a, b);
  if (!ref.has_primitive() || std::string(ref.primitive().name()) != "Matmul" || ref.inputs().size() != 2) {
    return std::nullopt;
  }
  const auto& x = ref.inputs()[0];
  const auto& w = ref.inputs()[1];
  if (x.ndim() < 3 || x.ndim() != w.ndim() || ref.dtype() != mx::float32) return std::nullopt;
  const size_t m = x.shape(-2), n = w.shape(-1), k = x.shape(-1);
  if (m * n == 0) return std::nullopt;
  const size_t batch = ref.size() / (m * n), each = m * n * k;
  if (batch < 2 || each > kEachUpTo || each * batch < kShareFrom) return std::nullopt;
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(ref.shape(), mx::float32, std::make_shared<BatchedMatmul>(stream), {x, w});
}

std::optional<mx::array> cpu_few_rows_matmul(const mx::array& x, const mx::array& b, const mx::array* c, float alpha,
                                             float beta) {
  if (!enabled() || mx::default_device() != mx::Device::cpu || blas::sgemv() == nullptr) return std::nullopt;
  if (x.ndim() < 1 || b.ndim() != 2 || x.shape(-1) != b.shape(0) || b.shape(0) == 0 || b.shape(1) == 0) {
    return std::nullopt;
  }
  const size_t rows = x.size() / b.shape(0);
  if (rows == 0 || rows > static_cast<size_t>(kFewRows)) return std::nullopt;
  if (x.dtype() != mx::float32 || b.dtype() != mx::float32) return std::nullopt;
  if (c && (c->dtype() != mx::float32 || c->ndim() != 1 || c->shape(0) != b.shape(1))) return std::nullopt;
  auto shape = x.shape();
  shape.back() = b.shape(1);
  std::vector<mx::array> inputs = {x, b};
  if (c) inputs.push_back(*c);
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<FewRowsMatmul>(stream, alpha, beta), inputs);
}

}  // namespace mlx_shim
