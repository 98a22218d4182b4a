//! The cxx bridge to `cpp/shim.h`. Nothing else lives here; safe wrappers are in the
//! sibling modules. Every function that can reach MLX returns `Result`, which is what
//! makes cxx catch the C++ exception instead of aborting.

// The bridge mirrors MLX's signatures (quantized_matmul takes eight arguments).
#[allow(clippy::too_many_arguments)]
#[cxx::bridge(namespace = "mlx_shim")]
pub(crate) mod ffi {
    unsafe extern "C++" {
        include!("mlx/cpp/shim.h");

        #[namespace = "mlx::core"]
        type array;
        type ArrayList;
        type Loaded;

        fn list_new() -> UniquePtr<ArrayList>;
        fn list_push(list: Pin<&mut ArrayList>, a: &array);
        fn list_get(list: &ArrayList, i: usize) -> Result<UniquePtr<array>>;
        fn list_len(list: &ArrayList) -> usize;

        fn from_f32(data: &[f32], shape: &[i32]) -> Result<UniquePtr<array>>;
        fn from_i32(data: &[i32], shape: &[i32]) -> Result<UniquePtr<array>>;
        fn from_u32(data: &[u32], shape: &[i32]) -> Result<UniquePtr<array>>;
        fn scalar_f32(v: f32, dtype: u8) -> Result<UniquePtr<array>>;
        fn zeros(shape: &[i32], dtype: u8) -> Result<UniquePtr<array>>;
        fn uninit(shape: &[i32], dtype: u8) -> Result<UniquePtr<array>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: u8) -> Result<UniquePtr<array>>;
        fn clone(a: &array) -> UniquePtr<array>;
        fn shape(a: &array) -> Vec<i32>;
        fn dtype(a: &array) -> u8;
        fn size(a: &array) -> usize;
        fn is_available(a: &array) -> bool;
        fn nbytes(a: &array) -> usize;
        fn to_f32(a: &array) -> Result<Vec<f32>>;
        fn to_i32(a: &array) -> Result<Vec<i32>>;
        fn to_u32(a: &array) -> Result<Vec<u32>>;
        fn astype(a: &array, dtype: u8) -> Result<UniquePtr<array>>;

        fn add(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn subtract(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn multiply(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn divide(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn maximum(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn minimum(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn greater(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn greater_equal(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn less(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn equal(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn logical_and(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn logical_or(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn power(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn floor_divide(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn bitwise_and(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn negative(a: &array) -> Result<UniquePtr<array>>;
        fn exp(a: &array) -> Result<UniquePtr<array>>;
        fn log(a: &array) -> Result<UniquePtr<array>>;
        fn sqrt(a: &array) -> Result<UniquePtr<array>>;
        fn sigmoid(a: &array) -> Result<UniquePtr<array>>;
        #[cxx_name = "where"]
        fn where_(cond: &array, a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn swiglu(gate: &array, x: &array) -> Result<UniquePtr<array>>;
        fn gelu_approx(x: &array) -> Result<UniquePtr<array>>;
        fn swiglu_oai(gate: &array, x: &array) -> Result<UniquePtr<array>>;
        fn silu(x: &array) -> Result<UniquePtr<array>>;
        fn precise_swiglu(h: &array, gate: &array, x: &array) -> Result<UniquePtr<array>>;
        fn softcap(x: &array, cap: f32) -> Result<UniquePtr<array>>;
        fn gated_delta_g(a_log: &array, a: &array, dt_bias: &array) -> Result<UniquePtr<array>>;
        fn gated_delta_step(
            q: &array,
            k: &array,
            v: &array,
            g: &array,
            beta: &array,
            state: &array,
        ) -> Result<UniquePtr<ArrayList>>;
        fn gated_delta_log_g(a_log: &array, a: &array, dt_bias: &array) -> Result<UniquePtr<array>>;
        fn gated_delta_chunked(
            q: &array,
            k: &array,
            v: &array,
            log_g: &array,
            beta: &array,
            state: &array,
            chunk: i32,
        ) -> Result<UniquePtr<ArrayList>>;
        fn conv1d(x: &array, w: &array, groups: i32) -> Result<UniquePtr<array>>;
        fn repeat_axis(a: &array, repeats: i32, axis: i32) -> Result<UniquePtr<array>>;
        fn rms_norm_plain(x: &array, eps: f32) -> Result<UniquePtr<array>>;

        fn sum(a: &array, axes: &[i32], keepdims: bool) -> Result<UniquePtr<array>>;
        fn max(a: &array, axes: &[i32], keepdims: bool) -> Result<UniquePtr<array>>;
        fn mean(a: &array, axes: &[i32], keepdims: bool) -> Result<UniquePtr<array>>;
        fn logsumexp(a: &array, axes: &[i32], keepdims: bool) -> Result<UniquePtr<array>>;
        fn argmax(a: &array, axis: i32, keepdims: bool) -> Result<UniquePtr<array>>;
        fn cumsum(a: &array, axis: i32, reverse: bool, inclusive: bool) -> Result<UniquePtr<array>>;

        fn reshape(a: &array, shape: &[i32]) -> Result<UniquePtr<array>>;
        fn transpose(a: &array, axes: &[i32]) -> Result<UniquePtr<array>>;
        fn expand_dims(a: &array, axes: &[i32]) -> Result<UniquePtr<array>>;
        fn squeeze(a: &array, axes: &[i32]) -> Result<UniquePtr<array>>;
        fn broadcast_to(a: &array, shape: &[i32]) -> Result<UniquePtr<array>>;
        fn slice(a: &array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<UniquePtr<array>>;
        fn slice_update(
            src: &array,
            update: &array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<array>>;
        fn take(a: &array, indices: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn take_along_axis(a: &array, indices: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn put_along_axis(a: &array, indices: &array, values: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn scatter_add_axis(a: &array, indices: &array, values: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn concatenate(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<array>>;
        fn masked_rows(logits: &array, rows: &ArrayList, neg_inf: &array) -> Result<UniquePtr<array>>;
        fn contiguous(a: &array) -> Result<UniquePtr<array>>;
        fn copy(a: &array) -> Result<UniquePtr<array>>;

        fn matmul(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn addmm(c: &array, a: &array, b: &array, alpha: f32, beta: f32) -> Result<UniquePtr<array>>;
        fn quantized_matmul(
            x: &array,
            w: &array,
            scales: &array,
            biases: &array,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
            host_kernels: bool,
        ) -> Result<UniquePtr<array>>;
        fn gather_mm(a: &array, b: &array, rhs_indices: &array, sorted_indices: bool) -> Result<UniquePtr<array>>;
        fn gather_qmm(
            x: &array,
            w: &array,
            scales: &array,
            biases: &array,
            rhs_indices: &array,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
            sorted_indices: bool,
        ) -> Result<UniquePtr<array>>;
        fn dequantize(
            w: &array,
            scales: &array,
            biases: &array,
            group_size: i32,
            bits: i32,
            mode: &str,
            dtype: u8,
        ) -> Result<UniquePtr<array>>;
        fn quantize(w: &array, group_size: i32, bits: i32, mode: &str) -> Result<UniquePtr<ArrayList>>;

        fn rms_norm(x: &array, weight: &array, eps: f32) -> Result<UniquePtr<array>>;
        fn rope(
            x: &array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offset: i32,
        ) -> Result<UniquePtr<array>>;
        fn rope_rows(
            x: &array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offsets: &array,
        ) -> Result<UniquePtr<array>>;
        fn rope_rows_freqs(
            x: &array,
            dims: i32,
            traditional: bool,
            scale: f32,
            offsets: &array,
            freqs: &array,
        ) -> Result<UniquePtr<array>>;
        fn rope_freqs(
            x: &array,
            dims: i32,
            traditional: bool,
            scale: f32,
            offset: i32,
            freqs: &array,
        ) -> Result<UniquePtr<array>>;
        fn sdpa(q: &array, k: &array, v: &array, scale: f32, mask_mode: &str) -> Result<UniquePtr<array>>;
        fn sdpa_masked(q: &array, k: &array, v: &array, scale: f32, mask: &array) -> Result<UniquePtr<array>>;
        fn sdpa_sinks(
            q: &array,
            k: &array,
            v: &array,
            scale: f32,
            mask_mode: &str,
            sinks: &array,
        ) -> Result<UniquePtr<array>>;
        fn sdpa_masked_sinks(
            q: &array,
            k: &array,
            v: &array,
            scale: f32,
            mask: &array,
            sinks: &array,
        ) -> Result<UniquePtr<array>>;
        fn short_causal_attention_applies(q: &array, k: &array, v: &array) -> bool;
        fn short_causal_attention(q: &array, k: &array, v: &array, scale: f32) -> Result<UniquePtr<array>>;

        fn softmax(a: &array, axes: &[i32], precise: bool) -> Result<UniquePtr<array>>;
        fn sort(a: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn argsort(a: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn argpartition(a: &array, kth: i32, axis: i32) -> Result<UniquePtr<array>>;
        fn random_key(seed: u64) -> Result<UniquePtr<array>>;
        fn random_categorical(logits: &array, axis: i32, key: &array) -> Result<UniquePtr<array>>;
        fn random_uniform(shape: &[i32], key: &array) -> Result<UniquePtr<array>>;

        fn eval(arrays: &ArrayList) -> Result<()>;
        fn async_eval(arrays: &ArrayList) -> Result<()>;
        fn graph_dot(arrays: &ArrayList) -> String;
        fn set_default_device_gpu(gpu: bool) -> Result<()>;
        fn default_device_is_gpu() -> bool;
        fn gpu_is_available() -> bool;
        fn device_memory_size(gpu: bool) -> Result<usize>;
        fn synchronize() -> Result<()>;
        fn distributed_init(backend: &str) -> Result<i32>;
        fn distributed_rank() -> Result<i32>;
        fn all_sum(a: &array) -> Result<UniquePtr<array>>;
        fn send_to(a: &array, dst: i32) -> Result<UniquePtr<array>>;
        fn recv_from(shape: &[i32], dtype: u8, src: i32) -> Result<UniquePtr<array>>;
        fn recv_after(shape: &[i32], dtype: u8, src: i32, after: &array) -> Result<UniquePtr<array>>;
        fn new_stream(gpu: bool) -> Result<i32>;
        fn set_default_stream(index: i32, gpu: bool) -> Result<()>;
        fn get_active_memory() -> usize;
        fn get_peak_memory() -> usize;
        fn get_cache_memory() -> usize;
        fn reset_peak_memory();
        fn set_memory_limit(limit: usize) -> usize;
        fn set_cache_limit(limit: usize) -> usize;
        fn clear_cache();
        fn version() -> String;
        fn exit_without_teardown(code: i32);
        fn cap_cpu_qmatmul_isa(level: i32) -> i32;
        fn set_cpu_exp_mode(mode: i32);
        fn cpu_quantized_products() -> bool;

        fn load_safetensors(path: &str) -> Result<UniquePtr<Loaded>>;
        fn load_gguf(path: &str) -> Result<UniquePtr<Loaded>>;
        fn save_safetensors(path: &str, loaded: &Loaded) -> Result<()>;
        fn save_gguf(path: &str, loaded: &Loaded) -> Result<()>;
        fn loaded_push_meta_string(loaded: Pin<&mut Loaded>, key: &str, value: &str);
        fn loaded_push_meta_strings(loaded: Pin<&mut Loaded>, key: &str, values: &[String]);
        fn loaded_push_meta_array(loaded: Pin<&mut Loaded>, key: &str, a: &array);
        fn loaded_new() -> UniquePtr<Loaded>;
        fn loaded_push(loaded: Pin<&mut Loaded>, name: &str, a: &array);
        fn loaded_len(loaded: &Loaded) -> usize;
        fn loaded_name(loaded: &Loaded, i: usize) -> Result<String>;
        fn loaded_array(loaded: &Loaded, i: usize) -> Result<UniquePtr<array>>;
        fn loaded_meta_keys(loaded: &Loaded) -> Vec<String>;
        fn loaded_meta_kind(loaded: &Loaded, key: &str) -> u8;
        fn loaded_meta_string(loaded: &Loaded, key: &str) -> Result<String>;
        fn loaded_meta_strings(loaded: &Loaded, key: &str) -> Result<Vec<String>>;
        fn loaded_meta_array(loaded: &Loaded, key: &str) -> Result<UniquePtr<array>>;
    }
}
