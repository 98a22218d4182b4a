// Causal attention of a long query on the CPU: MLX's CPU backend has no fused attention, and
// its fallback materialises every chunk's scores against all keys, masks them with a
// `where` and takes a softmax whose exp is scalar on x86 (its SIMD types are one lane wide
// there): 2.2 of the 2.6 s one SmolLM2 layer spent on 2,048 queries over 8,192 keys
// (bench/cpu-attention.py). This primitive takes the same inputs and, per head and block of
// query rows, multiplies with the BLAS MLX uses (cblas_sgemm, found at run time), only over
// the keys the block's rows can see, takes the softmax with an 8-lane exp (AVX2 and FMA
// where the CPU has them), and multiplies by the values. Float32 only; everything else, and
// short queries (whose explicit-mask path must stay MLX's own, op for op), goes to MLX.
#include "mlx/cpp/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/cpp/cpu_blas.h"
#include "mlx/primitives.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mx = mlx::core;

namespace mlx_shim {
namespace {

using blas::kNoTrans;
using blas::kRowMajor;
using blas::kTrans;

// Query rows per block: a block's scores (rows x visible keys) stay within a few MB.
constexpr int kRows = 64;

// softmax over x[0..n) in place, in float32 as MLX's precise softmax: the max, then
// exp(x - max) and their sum, then each divided by the sum (as a product with its inverse).
void softmax_scalar(float* x, int n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; i++) top = std::max(top, x[i]);
  float sum = 0.f;
  for (int i = 0; i < n; i++) {
    x[i] = std::exp(x[i] - top);
    sum += x[i];
  }
  const float inv = 1.f / sum;
  for (int i = 0; i < n; i++) x[i] *= inv;
}

#if defined(__x86_64__)
// exp for 8 lanes: n = round(x / ln 2), r = x - n ln 2 (in two parts), a degree-5 polynomial
// for e^r on [-ln2/2, ln2/2] (Cephes' expf coefficients, within 2 ulp), scaled by 2^n.
// Inputs are x - max <= 0; below -87.3 the result is flushed to 0.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) void softmax_avx2(float* x, int n) {
  const int whole = n & ~7;
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < whole; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = *std::max_element(lanes, lanes + 8);
  for (int i = whole; i < n; i++) top = std::max(top, x[i]);
  const __m256 top_v = _mm256_set1_ps(top);
  __m256 sum8_v = _mm256_setzero_ps();
  for (int i = 0; i < whole; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), top_v));
    _mm256_storeu_ps(x + i, e);
    sum8_v = _mm256_add_ps(sum8_v, e);
  }
  float sum = sum8(sum8_v);
  for (int i = whole; i < n; i++) {
    x[i] = std::exp(x[i] - top);
    sum += x[i];
  }
  const float inv = 1.f / sum;
  const __m256 inv_v = _mm256_set1_ps(inv);
  for (int i = 0; i < whole; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv_v));
  for (int i = whole; i < n; i++) x[i] *= inv;
}
#endif

using Softmax = void (*)(float*, int);

Softmax pick_softmax() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return softmax_avx2;
#endif
  return softmax_scalar;
}

// One [rows, D] matrix of an input: where its first row starts and how far apart rows are;
// rows not one after another in memory (an inner stride other than 1) are copied first.
struct Rows {
  const float* data;
  int stride;
};

Rows rows_of(const mx::array& a, int b, int h, int first, int count, std::vector<float>& copy) {
  const auto& st = a.strides();
  const float* base = a.data<float>() + b * st[0] + h * st[1] + first * st[2];
  const int d = a.shape(3);
  if (st[3] == 1) return {base, static_cast<int>(st[2])};
  copy.resize(static_cast<size_t>(count) * d);
  for (int r = 0; r < count; r++)
    for (int c = 0; c < d; c++) copy[static_cast<size_t>(r) * d + c] = base[r * st[2] + c * st[3]];
  return {copy.data(), d};
}

class CausalAttention : public mx::UnaryPrimitive {
 public:
  CausalAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& v = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(q);
    encoder.set_input_array(k);
    encoder.set_input_array(v);
    encoder.set_output_array(out);
    encoder.dispatch([q, k, v, out_ptr = out.data<float>(), scale = scale_]() {
      const int batch = q.shape(0), heads = q.shape(1), len = q.shape(2), d = q.shape(3);
      const int kv_heads = k.shape(1), keys = k.shape(2);
      const int group = heads / kv_heads, offset = keys - len;
      const blas::Sgemm gemm = blas::sgemm();
      static const Softmax softmax = pick_softmax();
      std::vector<float> scores, q_copy, k_copy, v_copy;
      for (int b = 0; b < batch; b++) {
        for (int h = 0; h < heads; h++) {
          // A head's keys and values, once for all its blocks (copied only where their rows
          // are not contiguous); each block reads the first `visible` rows.
          const Rows kr = rows_of(k, b, h / group, 0, keys, k_copy);
          const Rows vr = rows_of(v, b, h / group, 0, keys, v_copy);
          for (int first = 0; first < len; first += kRows) {
            const int rows = std::min(kRows, len - first);
            // The block's last row sees keys 0..offset + first + rows - 1.
            const int visible = offset + first + rows;
            const Rows qr = rows_of(q, b, h, first, rows, q_copy);
            scores.resize(static_cast<size_t>(rows) * visible);
            gemm(kRowMajor, kNoTrans, kTrans, rows, visible, d, scale, qr.data, qr.stride, kr.data, kr.stride, 0.f,
                 scores.data(), visible);
            for (int r = 0; r < rows; r++) {
              float* row = scores.data() + static_cast<size_t>(r) * visible;
              const int sees = offset + first + r + 1;
              softmax(row, sees);
              std::fill(row + sees, row + visible, 0.f);
            }
            float* o = out_ptr + ((static_cast<size_t>(b) * heads + h) * len + first) * d;
            gemm(kRowMajor, kNoTrans, kNoTrans, rows, d, visible, 1.f, scores.data(), visible, vr.data, vr.stride,
                 0.f, o, d);
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's CPU attention has no GPU version");
  }

  const char* name() const override { return "HostCausalAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const CausalAttention*>(&other);
    return o != nullptr && o->scale_ == scale_;
  }

 private:
  float scale_;
};

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_CPU_ATTENTION");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

}  // namespace

std::optional<mx::array> cpu_causal_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                              float scale) {
  const bool shapes = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && q.shape(0) == k.shape(0) &&
                      k.shape() == v.shape() && q.shape(3) == k.shape(3) && k.shape(1) > 0 &&
                      q.shape(1) % k.shape(1) == 0 && q.shape(2) > kShortQuery && q.shape(2) <= k.shape(2);
  const bool types = q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32;
  if (!enabled() || !shapes || !types || mx::default_device() != mx::Device::cpu || blas::sgemm() == nullptr) {
    return std::nullopt;
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(q.shape(), mx::float32, std::make_shared<CausalAttention>(stream, scale), {q, k, v});
}

}  // namespace mlx_shim
