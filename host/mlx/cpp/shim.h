// The C++ side of the `mlx` crate: thin functions over MLX that cxx can bind.
// Every function that can reach MLX is declared `Result` on the Rust side, so a C++
// exception (bad shape, out of memory) becomes an `Err`, never an abort.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace mlx_shim {

using mlx::core::array;
using Ptr = std::unique_ptr<array>;

// A list of arrays crossing the boundary in either direction.
struct ArrayList {
  std::vector<array> items;
};

// What load_safetensors / load_gguf return: named arrays plus metadata.
struct Loaded {
  std::vector<std::string> names;
  std::vector<array> arrays;
  std::unordered_map<std::string, mlx::core::GGUFMetaData> gguf_meta;
  std::unordered_map<std::string, std::string> string_meta;
};

// Lists.
std::unique_ptr<ArrayList> list_new();
void list_push(ArrayList& list, const array& a);
Ptr list_get(const ArrayList& list, size_t i);
size_t list_len(const ArrayList& list);

// Creation and readback.
Ptr from_f32(rust::Slice<const float> data, rust::Slice<const int32_t> shape);
Ptr from_i32(rust::Slice<const int32_t> data, rust::Slice<const int32_t> shape);
Ptr from_u32(rust::Slice<const uint32_t> data, rust::Slice<const int32_t> shape);
Ptr scalar_f32(float v, uint8_t dtype);
Ptr zeros(rust::Slice<const int32_t> shape, uint8_t dtype);
Ptr uninit(rust::Slice<const int32_t> shape, uint8_t dtype);
Ptr arange(double start, double stop, double step, uint8_t dtype);
Ptr clone(const array& a);
rust::Vec<int32_t> shape(const array& a);
uint8_t dtype(const array& a);
size_t size(const array& a);
bool is_available(const array& a);
size_t nbytes(const array& a);
rust::Vec<float> to_f32(const array& a);
rust::Vec<int32_t> to_i32(const array& a);
rust::Vec<uint32_t> to_u32(const array& a);
Ptr astype(const array& a, uint8_t dtype);

// Elementwise.
Ptr add(const array& a, const array& b);
Ptr subtract(const array& a, const array& b);
Ptr multiply(const array& a, const array& b);
Ptr divide(const array& a, const array& b);
Ptr maximum(const array& a, const array& b);
Ptr minimum(const array& a, const array& b);
Ptr greater(const array& a, const array& b);
Ptr greater_equal(const array& a, const array& b);
Ptr less(const array& a, const array& b);
Ptr equal(const array& a, const array& b);
Ptr logical_and(const array& a, const array& b);
Ptr logical_or(const array& a, const array& b);
Ptr power(const array& a, const array& b);
Ptr floor_divide(const array& a, const array& b);
Ptr bitwise_and(const array& a, const array& b);
Ptr negative(const array& a);
Ptr exp(const array& a);
Ptr log(const array& a);
Ptr sqrt(const array& a);
Ptr sigmoid(const array& a);
Ptr where(const array& cond, const array& a, const array& b);
Ptr swiglu(const array& gate, const array& x);
Ptr gelu_approx(const array& x);
Ptr swiglu_oai(const array& gate, const array& x);
Ptr silu(const array& x);
Ptr precise_swiglu(const array& h, const array& gate, const array& x);
Ptr softcap(const array& x, float cap);
Ptr gated_delta_g(const array& a_log, const array& a, const array& dt_bias);
std::unique_ptr<ArrayList> gated_delta_step(const array& q, const array& k, const array& v, const array& g,
                                             const array& beta, const array& state);
Ptr gated_delta_log_g(const array& a_log, const array& a, const array& dt_bias);
std::unique_ptr<ArrayList> gated_delta_chunked(const array& q, const array& k, const array& v, const array& log_g,
                                               const array& beta, const array& state, int32_t chunk);
Ptr conv1d(const array& x, const array& w, int32_t groups);
Ptr repeat_axis(const array& a, int32_t repeats, int32_t axis);
Ptr rms_norm_plain(const array& x, float eps);

// Reductions.
Ptr sum(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
Ptr max(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
Ptr mean(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
Ptr logsumexp(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
Ptr argmax(const array& a, int32_t axis, bool keepdims);
Ptr cumsum(const array& a, int32_t axis, bool reverse, bool inclusive);

// Shapes and indexing.
Ptr reshape(const array& a, rust::Slice<const int32_t> shape);
Ptr transpose(const array& a, rust::Slice<const int32_t> axes);
Ptr expand_dims(const array& a, rust::Slice<const int32_t> axes);
Ptr squeeze(const array& a, rust::Slice<const int32_t> axes);
Ptr broadcast_to(const array& a, rust::Slice<const int32_t> shape);
Ptr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop,
          rust::Slice<const int32_t> strides);
Ptr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                 rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
Ptr take(const array& a, const array& indices, int32_t axis);
Ptr take_along_axis(const array& a, const array& indices, int32_t axis);
Ptr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis);
Ptr scatter_add_axis(const array& a, const array& indices, const array& values, int32_t axis);
Ptr concatenate(const ArrayList& arrays, int32_t axis);
Ptr masked_rows(const array& logits, const ArrayList& rows, const array& neg_inf);
Ptr contiguous(const array& a);
Ptr copy(const array& a);

// Linear algebra and quantization.
Ptr matmul(const array& a, const array& b);
Ptr addmm(const array& c, const array& a, const array& b, float alpha, float beta);
// `mode` is MLX's quantization mode ("affine", "mxfp4", ...); `biases` is read only in
// affine mode (the others have none). With host_kernels, the host's 4-bit matrix-vector
// kernel where it applies (qmv4_applies in shim.cc, affine only); MLX's own kernel otherwise.
Ptr quantized_matmul(const array& x, const array& w, const array& scales, const array& biases,
                     bool transpose, int32_t group_size, int32_t bits, rust::Str mode,
                     bool host_kernels);
Ptr gather_mm(const array& a, const array& b, const array& rhs_indices, bool sorted_indices);
Ptr gather_qmm(const array& x, const array& w, const array& scales, const array& biases,
               const array& rhs_indices, bool transpose, int32_t group_size, int32_t bits,
               rust::Str mode, bool sorted_indices);
Ptr dequantize(const array& w, const array& scales, const array& biases, int32_t group_size,
               int32_t bits, rust::Str mode, uint8_t dtype);
std::unique_ptr<ArrayList> quantize(const array& w, int32_t group_size, int32_t bits, rust::Str mode);

// Fast kernels.
Ptr rms_norm(const array& x, const array& weight, float eps);
Ptr rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset);
Ptr rope_rows(const array& x, int32_t dims, bool traditional, float base, float scale,
              const array& offsets);
Ptr rope_rows_freqs(const array& x, int32_t dims, bool traditional, float scale, const array& offsets,
                    const array& freqs);
Ptr rope_freqs(const array& x, int32_t dims, bool traditional, float scale, int32_t offset,
               const array& freqs);
Ptr sdpa(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode);
Ptr sdpa_masked(const array& q, const array& k, const array& v, float scale, const array& mask);
Ptr sdpa_sinks(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode,
               const array& sinks);
Ptr sdpa_masked_sinks(const array& q, const array& k, const array& v, float scale, const array& mask,
                      const array& sinks);
bool short_causal_attention_applies(const array& q, const array& k, const array& v);
Ptr short_causal_attention(const array& q, const array& k, const array& v, float scale);

// Sampling.
Ptr softmax(const array& a, rust::Slice<const int32_t> axes, bool precise);
Ptr sort(const array& a, int32_t axis);
Ptr argsort(const array& a, int32_t axis);
Ptr argpartition(const array& a, int32_t kth, int32_t axis);
Ptr random_key(uint64_t seed);
Ptr random_categorical(const array& logits, int32_t axis, const array& key);
Ptr random_uniform(rust::Slice<const int32_t> shape, const array& key);

// Evaluation, devices, memory.
void eval(const ArrayList& arrays);
void async_eval(const ArrayList& arrays);
rust::String graph_dot(const ArrayList& arrays);
void set_default_device_gpu(bool gpu);
bool default_device_is_gpu();
bool gpu_is_available();
size_t device_memory_size(bool gpu);
void synchronize();
// Distributed (mlx::core::distributed): one process-wide group, set by distributed_init.
int32_t distributed_init(rust::Str backend);
int32_t distributed_rank();
Ptr all_sum(const array& a);
Ptr send_to(const array& a, int32_t dst);
Ptr recv_from(rust::Slice<const int32_t> shape, uint8_t dtype, int32_t src);
Ptr recv_after(rust::Slice<const int32_t> shape, uint8_t dtype, int32_t src, const array& after);
int32_t new_stream(bool gpu);
void set_default_stream(int32_t index, bool gpu);
size_t get_active_memory();
size_t get_peak_memory();
size_t get_cache_memory();
void reset_peak_memory();
size_t set_memory_limit(size_t limit);
size_t set_cache_limit(size_t limit);
void clear_cache();
rust::String version();
void exit_without_teardown(int32_t code);
// The widest instruction set the CPU quantized product may use: 3 AVX-512, 2 AVX2, 1 portable
// C++ (tests run the narrower kernels with it).
int32_t cap_cpu_qmatmul_isa(int32_t level);
void set_cpu_exp_mode(int32_t mode);
// Whether the CPU quantized product is on (HOST_CPU_QMATMUL unset or not 0).
bool cpu_quantized_products();

// Files.
std::unique_ptr<Loaded> load_safetensors(rust::Str path);
std::unique_ptr<Loaded> load_gguf(rust::Str path);
void save_safetensors(rust::Str path, const Loaded& loaded);
void save_gguf(rust::Str path, const Loaded& loaded);
void loaded_push_meta_string(Loaded& loaded, rust::Str key, rust::Str value);
void loaded_push_meta_strings(Loaded& loaded, rust::Str key, rust::Slice<const rust::String> values);
void loaded_push_meta_array(Loaded& loaded, rust::Str key, const array& a);
std::unique_ptr<Loaded> loaded_new();
void loaded_push(Loaded& loaded, rust::Str name, const array& a);
size_t loaded_len(const Loaded& loaded);
rust::String loaded_name(const Loaded& loaded, size_t i);
Ptr loaded_array(const Loaded& loaded, size_t i);
rust::Vec<rust::String> loaded_meta_keys(const Loaded& loaded);
// 0 absent, 1 array, 2 string, 3 list of strings.
uint8_t loaded_meta_kind(const Loaded& loaded, rust::Str key);
rust::String loaded_meta_string(const Loaded& loaded, rust::Str key);
rust::Vec<rust::String> loaded_meta_strings(const Loaded& loaded, rust::Str key);
Ptr loaded_meta_array(const Loaded& loaded, rust::Str key);

}  // namespace mlx_shim
