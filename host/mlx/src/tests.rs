use crate::fast::Mask;
use crate::*;

fn arr(data: &[f32], shape: &[usize]) -> Array {
    Array::from_f32(data, shape).unwrap()
}

#[test]
fn creation_and_readback_round_trip() {
    let a = arr(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    assert_eq!(a.shape(), vec![2, 3]);
    assert_eq!(a.dtype(), Dtype::Float32);
    assert_eq!(a.to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let t = a.transpose(&[1, 0]).unwrap();
    assert_eq!(t.to_vec_f32().unwrap(), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    let i = Array::from_i32(&[3, -1], &[2]).unwrap();
    assert_eq!(i.to_vec_i32().unwrap(), vec![3, -1]);
}

/// An unwritten buffer (`Array::uninit`) takes writes in place and reads back what was written
/// (a KV cache's room), its untouched part whatever it held; an absurd shape is an error.
#[test]
fn an_unwritten_buffer_reads_back_what_is_written_into_it() {
    let room = Array::uninit(&[2, 3, 4], Dtype::Float32).unwrap();
    assert_eq!((room.shape(), room.dtype()), (vec![2, 3, 4], Dtype::Float32));
    let ones = arr(&[1.0; 12], &[2, 3, 2]);
    let half = room.slice_update(&ones, &[0, 0, 0], &[2, 3, 2], &[1, 1, 1]).unwrap();
    let full = half
        .slice_update(
            &ones.multiply(&Array::scalar(2.0, Dtype::Float32).unwrap()).unwrap(),
            &[0, 0, 2],
            &[2, 3, 4],
            &[1, 1, 1],
        )
        .unwrap();
    let want: Vec<f32> = (0..24).map(|i| if i % 4 < 2 { 1.0 } else { 2.0 }).collect();
    assert_eq!(full.to_vec_f32().unwrap(), want);
    assert_eq!(half.slice_axis(2, 0, 2).unwrap().to_vec_f32().unwrap(), vec![1.0; 12]);
    assert!(Array::uninit(&[1 << 31, 4], Dtype::Float32).is_err());
}

#[test]
fn buffer_that_does_not_match_its_shape_is_an_error() {
    let err = Array::from_f32(&[1.0, 2.0, 3.0], &[2, 2]).unwrap_err();
    assert!(err.to_string().contains("3 elements but the shape needs 4"), "{err}");
}

#[test]
fn mlx_exceptions_become_errors_not_aborts() {
    let a = arr(&[1.0; 6], &[2, 3]);
    let b = arr(&[1.0; 6], &[2, 3]);
    let err = ops::matmul(&a, &b).unwrap_err();
    assert!(matches!(err, Error::Mlx(_)), "{err}");
    let err = a.reshape(&[4, 2]).unwrap_err();
    assert!(err.to_string().contains("reshape") || err.to_string().contains("shape"), "{err}");
    let missing = io::load_safetensors(std::path::Path::new("/nonexistent/x.safetensors")).unwrap_err();
    assert!(matches!(missing, Error::Mlx(_)));
}

#[test]
fn arithmetic_reductions_and_matmul() {
    let a = arr(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = arr(&[1.0, 0.0, 0.0, 1.0], &[2, 2]);
    assert_eq!(ops::matmul(&a, &b).unwrap().to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(a.add(&b).unwrap().to_vec_f32().unwrap(), vec![2.0, 2.0, 3.0, 5.0]);
    assert_eq!(a.sum(&[1], false).unwrap().to_vec_f32().unwrap(), vec![3.0, 7.0]);
    assert_eq!(a.argmax(-1, false).unwrap().to_vec_i32().unwrap(), vec![1, 1]);
    let bias = arr(&[10.0, 20.0], &[2]);
    let y = ops::addmm(&bias, &a, &b, 1.0, 1.0).unwrap();
    assert_eq!(y.to_vec_f32().unwrap(), vec![11.0, 22.0, 13.0, 24.0]);
    let lse = arr(&[0.0, 0.0], &[1, 2]).logsumexp(&[-1], true).unwrap().item_f32().unwrap();
    assert!((lse - 2f32.ln()).abs() < 1e-6);
}

#[test]
fn slicing_and_updates() {
    let a = Array::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[3, 4]).unwrap();
    let s = a.slice_axis(1, 1, 3).unwrap();
    assert_eq!(s.to_vec_f32().unwrap(), vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    let z = Array::zeros(&[3, 2], Dtype::Float32).unwrap();
    let u = a.slice_update(&z, &[0, 1], &[3, 3], &[1, 1]).unwrap();
    assert_eq!(u.to_vec_f32().unwrap()[..4], [0.0, 0.0, 0.0, 3.0]);
    let idx = Array::from_i32(&[2, 0], &[2]).unwrap();
    assert_eq!(a.take(&idx, 0).unwrap().to_vec_f32().unwrap()[..4], [8.0, 9.0, 10.0, 11.0]);
    let cat = ops::concatenate(&[&s, &s], 0).unwrap();
    assert_eq!(cat.shape(), vec![6, 2]);
}

#[test]
fn quantize_round_trips_within_a_step() {
    let data: Vec<f32> = (0..4 * 64).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let w = arr(&data, &[4, 64]);
    let (q, scales, biases) = ops::quantize(&w, 32, 4).unwrap();
    let affine = ops::Quant { mode: "affine", group_size: 32, bits: 4, biases: Some(&biases) };
    let back = ops::dequantize(&q, &scales, affine, Dtype::Float32).unwrap().to_vec_f32().unwrap();
    let max_err = data.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(max_err < 2.0 / 15.0, "max error {max_err}");
    let x = arr(&[1.0; 64], &[1, 64]);
    let y = ops::quantized_matmul(&x, &q, &scales, affine, true).unwrap();
    assert_eq!(y.shape(), vec![1, 4]);
}

/// MXFP4 (gpt-oss's experts in mlx-community's folders): FP4 values with one power-of-two
/// scale per 32, no biases. The product equals the product with the dequantized matrix, as
/// does the gathered product of a stack of such matrices.
#[test]
fn mxfp4_products_equal_products_with_the_dequantized_matrix() {
    let data: Vec<f32> = (0..3 * 8 * 64).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let w = arr(&data, &[3, 8, 64]);
    let (q, scales, biases) = ops::quantize_mode(&w, 32, 4, "mxfp4").unwrap();
    assert!(biases.is_none() && scales.dtype() == Dtype::Uint8, "{:?}", scales.dtype());
    let mx = ops::Quant { mode: "mxfp4", group_size: 32, bits: 4, biases: None };
    let dense = ops::dequantize(&q, &scales, mx, Dtype::Float32).unwrap();
    let back = dense.to_vec_f32().unwrap();
    let max_err = data.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(max_err < 0.26, "max error {max_err}");
    let x = arr(&noise(2 * 64, 7), &[2, 1, 64]);
    let e = |i: i32| dense.slice_axis(0, i, i + 1).unwrap().reshape(&[8, 64]).unwrap();
    let max_diff = |a: &Array, b: &Array| {
        let (a, b) = (a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
        assert_eq!(a.len(), b.len());
        a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    };
    // Expert 0 alone, as a plain quantized matrix.
    let q0 = q.slice_axis(0, 0, 1).unwrap().reshape(&[8, 8]).unwrap();
    let s0 = scales.slice_axis(0, 0, 1).unwrap().reshape(&[8, 2]).unwrap();
    let got = ops::quantized_matmul(&x, &q0, &s0, mx, true).unwrap();
    let want = ops::matmul(&x, &e(0).transpose(&[1, 0]).unwrap()).unwrap();
    assert!(max_diff(&got, &want) < 1e-4);
    let idx = Array::from_i32(&[2, 1], &[2]).unwrap();
    let gathered = ops::gather_qmm(&x, &q, &scales, mx, &idx, true, false).unwrap();
    for (row, expert) in [(0, 2), (1, 1)] {
        let xr = x.slice_axis(0, row, row + 1).unwrap();
        let want = ops::matmul(&xr, &e(expert).transpose(&[1, 0]).unwrap()).unwrap();
        assert!(max_diff(&gathered.slice_axis(0, row, row + 1).unwrap().reshape(&[1, 1, 8]).unwrap(), &want) < 1e-4);
    }
}

#[test]
fn fast_kernels_agree_with_their_definitions() {
    let x = arr(&[1.0, 2.0, 3.0, 4.0], &[1, 4]);
    let w = arr(&[1.0; 4], &[4]);
    let y = fast::rms_norm(&x, &w, 0.0).unwrap().to_vec_f32().unwrap();
    let rms = (30.0f32 / 4.0).sqrt();
    for (a, b) in y.iter().zip([1.0, 2.0, 3.0, 4.0]) {
        assert!((a - b / rms).abs() < 1e-5);
    }
    // Position 0 leaves a vector unrotated.
    let r = fast::rope(&x.reshape(&[1, 1, 1, 4]).unwrap(), 4, false, 10000.0, 1.0, 0).unwrap();
    assert_eq!(r.to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    // One key: attention returns its value.
    let q = arr(&[1.0, 0.0], &[1, 1, 1, 2]);
    let v = arr(&[5.0, 7.0], &[1, 1, 1, 2]);
    let o = fast::scaled_dot_product_attention(&q, &q, &v, 1.0, Mask::None).unwrap();
    assert_eq!(o.to_vec_f32().unwrap(), vec![5.0, 7.0]);
}

/// On a CUDA GPU `masked_rows` is the host's kernel (one row of refused tokens per logits
/// row, read where it lies, groups of 8): it must give exactly `where(concatenate, -inf,
/// logits)`, in every float dtype, for a vocabulary that is no multiple of the block and for
/// more rows than a group. (On the CPU both sides are MLX's ops.)
#[test]
fn masked_rows_are_where_over_the_concatenated_rows() {
    let vocab = 1000;
    for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
        for batch in [1, 3, 8, 11] {
            let values: Vec<f32> = (0..batch * vocab).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
            let logits = arr(&values, &[batch, vocab]).astype(dtype).unwrap();
            let refused: Vec<Array> = (0..batch)
                .map(|r| {
                    let bits: Vec<f32> = (0..vocab).map(|t| ((t * 31 + r * 17) % 5 < 2) as u8 as f32).collect();
                    arr(&bits, &[1, vocab]).astype(Dtype::Bool).unwrap()
                })
                .collect();
            let rows: Vec<&Array> = refused.iter().collect();
            let neg_inf = Array::scalar(f32::NEG_INFINITY, dtype).unwrap();
            let got = ops::masked_rows(&logits, &rows, &neg_inf).unwrap();
            let want = ops::where_(&ops::concatenate(&rows, 0).unwrap(), &neg_inf, &logits).unwrap();
            assert_eq!((got.shape(), got.dtype()), (vec![batch, vocab], dtype));
            let (got, want) = (got.astype(Dtype::Float32).unwrap(), want.astype(Dtype::Float32).unwrap());
            let (got, want) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} batch {batch}");
            assert!(got.iter().filter(|v| **v == f32::NEG_INFINITY).count() >= batch * vocab / 3);
        }
    }
    let err = ops::masked_rows(&arr(&[0.0; 6], &[2, 3]), &[&arr(&[1.0; 3], &[1, 3])], &arr(&[0.0], &[])).unwrap_err();
    assert!(err.to_string().contains("B refused rows"), "{err}");
}

#[test]
fn swiglu_is_silu_gate_times_x() {
    let g = arr(&[-1.0, 0.0, 2.0], &[3]);
    let x = arr(&[2.0, 3.0, 0.5], &[3]);
    let y = ops::swiglu(&g, &x).unwrap().to_vec_f32().unwrap();
    let silu = |v: f32| v / (1.0 + (-v).exp());
    for (i, (gv, xv)) in [(-1.0f32, 2.0f32), (0.0, 3.0), (2.0, 0.5)].into_iter().enumerate() {
        assert!((y[i] - silu(gv) * xv).abs() < 1e-6);
    }
}

#[test]
fn a_fixed_key_gives_fixed_samples() {
    let logits = arr(&[0.0, 0.1, 0.2, 0.3, 0.0, 0.5, 0.1, 0.2], &[1, 8]);
    let draw = |seed: u64| -> Vec<i32> {
        (0..16u64)
            .map(|i| {
                let key = random::key(seed * 1000 + i).unwrap();
                random::categorical(&logits, -1, &key).unwrap().item_i32().unwrap()
            })
            .collect()
    };
    assert_eq!(draw(1), draw(1));
    assert_ne!(draw(1), draw(2));
}

#[test]
fn safetensors_round_trip() {
    let dir = std::env::temp_dir().join(format!("mlx-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.safetensors");
    let a = arr(&[1.0, 2.0], &[2]);
    io::save_safetensors(&path, &[("a", &a)]).unwrap();
    let t = io::load_safetensors(&path).unwrap();
    assert_eq!(t.arrays["a"].to_vec_f32().unwrap(), vec![1.0, 2.0]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn memory_stats_move() {
    memory::reset_peak();
    let a = Array::zeros(&[1024, 1024], Dtype::Float32).unwrap();
    a.eval().unwrap();
    assert!(memory::peak() >= 4 << 20);
    assert!(memory::active() >= 4 << 20);
    assert_eq!(Device::default_device(), if Device::gpu_available() { Device::Gpu } else { Device::Cpu });
}

#[test]
fn work_on_a_new_stream_evaluates() {
    let s = Stream::new(Device::Cpu).unwrap();
    s.set_default().unwrap();
    let a = arr(&[1.0, 2.0], &[2]).add(&arr(&[3.0, 4.0], &[2])).unwrap();
    assert_eq!(a.to_vec_f32().unwrap(), vec![4.0, 6.0]);
}

#[test]
fn gguf_round_trip_with_metadata() {
    let dir = std::env::temp_dir().join(format!("mlx-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.gguf");
    let a = arr(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let meta = [
        ("general.architecture", io::GgufValue::String("llama".into())),
        ("tokenizer.ggml.tokens", io::GgufValue::Strings(vec!["a".into(), "b".into()])),
        ("llama.block_count", io::GgufValue::Array(Array::from_u32(&[3], &[1]).unwrap())),
    ];
    io::save_gguf(&path, &[("w.weight", &a)], &meta).unwrap();
    let t = io::load_gguf(&path).unwrap();
    assert_eq!(t.arrays["w.weight"].to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert!(matches!(&t.gguf["general.architecture"], io::GgufValue::String(s) if s == "llama"));
    assert!(matches!(&t.gguf["tokenizer.ggml.tokens"], io::GgufValue::Strings(v) if v.len() == 2));
    match &t.gguf["llama.block_count"] {
        io::GgufValue::Array(a) => assert_eq!(a.to_vec_i32().unwrap(), vec![3]),
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn readback_of_a_lazy_result_converts_dtype_and_layout_after_evaluating() {
    // The sum is evaluated on its own stream first; the int -> float conversion and the
    // transpose's reordering happen afterwards, on the host.
    let i = Array::from_i32(&[1, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
    let lazy = i.add(&i).unwrap().transpose(&[1, 0]).unwrap();
    assert_eq!(lazy.to_vec_f32().unwrap(), vec![2.0, 8.0, 4.0, 10.0, 6.0, 12.0]);
    let f = arr(&[1.5, -2.0], &[2]).multiply(&arr(&[2.0, 2.0], &[2])).unwrap();
    assert_eq!(f.to_vec_i32().unwrap(), vec![3, -4]);
}

#[test]
fn readback_converts_every_stored_dtype_and_any_strides_on_the_host() {
    // Half types, unsigned argmax results, strides of 0 (broadcast), negative offsets into a
    // buffer (slices) and 0-d arrays all come out in row-major order as the asked type.
    let x = arr(&[1.5, -2.25, 3.0, 256.0], &[4]);
    for dt in [Dtype::Bfloat16, Dtype::Float16] {
        let h = x.astype(dt).unwrap();
        assert_eq!(h.to_vec_f32().unwrap(), vec![1.5, -2.25, 3.0, 256.0], "{dt:?}");
        assert_eq!(h.to_vec_i32().unwrap(), vec![1, -2, 3, 256], "{dt:?}");
    }
    let m = arr(&[0.0, 5.0, 1.0, 9.0, 2.0, 3.0], &[2, 3]);
    let am = m.argmax(1, false).unwrap();
    assert_eq!(am.dtype(), Dtype::Uint32);
    assert_eq!(am.to_vec_i32().unwrap(), vec![1, 0]);
    let b = arr(&[1.0, 2.0], &[2, 1]).broadcast_to(&[2, 3]).unwrap();
    assert_eq!(b.to_vec_f32().unwrap(), vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
    let s = m.transpose(&[1, 0]).unwrap().slice_axis(0, 1, 3).unwrap();
    assert_eq!(s.to_vec_f32().unwrap(), vec![5.0, 2.0, 1.0, 3.0]);
    assert_eq!(Array::scalar(7.0, Dtype::Bfloat16).unwrap().item_i32().unwrap(), 7);
}

#[test]
fn graph_dot_shows_the_primitives_still_to_run() {
    let a = arr(&[1.0, 2.0], &[2]);
    let lazy = a.add(&a).unwrap().exp().unwrap();
    let dot = graph_dot(&[&lazy]);
    assert!(dot.starts_with("digraph") && dot.contains("Add") && dot.contains("Exp"), "{dot}");
    eval(&[&lazy]).unwrap();
    assert!(!graph_dot(&[&lazy]).contains("Add"), "an evaluated array has no graph behind it");
}

/// Deterministic values in [-1, 1) (a 64-bit LCG; no test depends on MLX's random streams).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The host's 4-bit matrix-vector kernels (`shim.cc`: qmv4 for one activation row, qmm4 for a
/// batch of 2-32) against MLX's quantized matmul on random inputs. On a CUDA GPU (run there
/// through the device kit) every bf16/f16 case of at most 32 rows must take a kernel and agree
/// with MLX within a bound per dtype, relative to the largest output: both accumulate in
/// float32, so the difference is summation order plus the final rounding to 16 bits (bf16
/// keeps 8 significant bits: 1e-2; f16 11: 2e-3). Cases the kernels do not serve (more rows,
/// float32, 8 bits) must fall back to MLX's kernel and give its result exactly; on the CPU
/// every float32 case takes the host's CPU product (cpu_qmatmul.cc, float32 sums: 1e-5), every
/// bfloat16 one its bfloat16 kernel (MLX's bits: exact), the rest MLX's. Which one ran shows in the product's graph: MLX's is a `QuantizedMatmul`, the
/// host's a custom kernel.
#[test]
fn quantized_matvec_kernel_matches_mlx() {
    let cuda = Device::default_device() == Device::Gpu && !cfg!(target_os = "macos");
    // (rows, input width, group size, bits, activation rows)
    let cases = [
        (64, 256, 64, 4, 1),
        (301, 512, 32, 4, 1),
        (1024, 4096, 64, 4, 1),
        (257, 2048, 128, 4, 1),
        (96, 4096, 64, 4, 3),
        (64, 512, 64, 8, 1),
        // A batch of activation rows (qmm4), up to its 32; 33 is MLX's.
        (300, 1024, 64, 4, 8),
        (130, 2048, 32, 4, 32),
        (64, 512, 64, 4, 33),
    ];
    for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
        for (i, &(rows, input, group, bits, xrows)) in cases.iter().enumerate() {
            let w = arr(&noise(rows * input, i as u64), &[rows, input]).astype(dtype).unwrap();
            let (q, scales, biases) = ops::quantize(&w, group, bits).unwrap();
            let x = arr(&noise(xrows * input, 100 + i as u64), &[1, xrows, input]).astype(dtype).unwrap();
            let serves = xrows <= 32 && bits == 4 && dtype != Dtype::Float32;
            // On the CPU, float32 products of 4- and 8-bit weights are the host's (cpu_qmatmul.cc),
            // and bfloat16 ones where AVX-512 runs its bfloat16 kernel (MLX's bits exactly).
            let cpu = !cuda && Device::default_device() == Device::Cpu;
            let cpu_bf16 = cpu && dtype == Dtype::Bfloat16;
            let cpu_serves = cpu && (dtype == Dtype::Float32 || cpu_bf16);
            let quant = ops::Quant { mode: "affine", group_size: group, bits, biases: Some(&biases) };
            let got = ops::quantized_matmul(&x, &q, &scales, quant, true).unwrap();
            let applies = !graph_dot(&[&got]).contains("QuantizedMatmul");
            assert_eq!(applies, (cuda && serves) || cpu_serves, "{dtype:?} case {i}: kernel applies");
            // MLX's own kernel, always: the reference.
            let want = crate::array::wrap(crate::ffi::ffi::quantized_matmul(
                &x.0, &q.0, &scales.0, &biases.0, true, group, bits, "affine", false,
            ))
            .unwrap();
            assert_eq!(got.shape(), vec![1, xrows, rows]);
            assert_eq!(got.dtype(), dtype);
            let (got, want) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
            let bound = match (applies, dtype) {
                (false, _) => 0.0,
                (true, Dtype::Bfloat16) if cpu_bf16 => 0.0,
                (true, Dtype::Float32) => 1e-5,
                (true, Dtype::Bfloat16) => 1e-2,
                (true, _) => 2e-3,
            };
            assert!(err <= bound, "{dtype:?} case {i} {:?}: max error {err:e} > {bound:e}", cases[i]);
            if applies {
                eprintln!(
                    "qmv4 {dtype:?} rows {rows} in {input} group {group} x rows {xrows}: max rel. error {err:.2e}"
                );
            }
        }
    }
}

#[test]
fn bitwise_and_and_availability() {
    let words = Array::from_u32(&[0b1010, u32::MAX], &[2, 1]).unwrap();
    let pow2 = Array::from_u32(&[1, 2, 4, 8], &[1, 4]).unwrap();
    let bits = words.bitwise_and(&pow2).unwrap();
    // A constant is available at once; a result only once computed.
    assert!(words.is_available() && !bits.is_available());
    assert_eq!(bits.to_vec_u32().unwrap(), vec![0, 2, 0, 8, 1, 2, 4, 8]);
    assert!(bits.is_available());
}

/// On the CPU a causal query longer than 32 positions is the host's own attention
/// (`cpu_attention.cc`): it must agree with attention worked out plainly (in f64, here) for
/// grouped heads, a query shorter than the keys (a later prefill chunk), a query that is no
/// multiple of the 64-row block, keys that are a slice of a longer cache, and keys whose
/// rows are not contiguous.
#[test]
fn long_causal_queries_on_the_cpu_attend_as_the_definition() {
    if Device::default_device() == Device::Gpu {
        return;
    }
    let (heads, kv_heads, len, keys, d) = (4usize, 2usize, 70usize, 90usize, 16usize);
    let values = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 250.0) - 2.0).collect()
    };
    let q_data = values(heads * len * d, 1);
    let (k_data, v_data) = (values(kv_heads * keys * d, 2), values(kv_heads * keys * d, 3));
    let q = arr(&q_data, &[1, heads, len, d]);
    // Keys: the first `keys` rows of a longer cache; values: stored transposed.
    let mut long_k = vec![0f32; kv_heads * 120 * d];
    for h in 0..kv_heads {
        let rows = &k_data[h * keys * d..(h + 1) * keys * d];
        long_k[h * 120 * d..h * 120 * d + keys * d].copy_from_slice(rows);
    }
    let k = arr(&long_k, &[1, kv_heads, 120, d]).slice_axis(2, 0, keys as i32).unwrap();
    let mut v_t = vec![0f32; kv_heads * d * keys];
    for h in 0..kv_heads {
        for s in 0..keys {
            for c in 0..d {
                v_t[(h * d + c) * keys + s] = v_data[(h * keys + s) * d + c];
            }
        }
    }
    let v = arr(&v_t, &[1, kv_heads, d, keys]).transpose(&[0, 1, 3, 2]).unwrap();
    let scale = 0.3f32;
    let o = fast::scaled_dot_product_attention(&q, &k, &v, scale, Mask::Causal).unwrap();
    assert!(graph_dot(&[&o]).contains("HostCausalAttention"), "not the host's attention");
    let got = o.to_vec_f32().unwrap();
    let mut worst = 0f64;
    for h in 0..heads {
        let kvh = h / (heads / kv_heads);
        for i in 0..len {
            let sees = keys - len + i + 1;
            let qi = &q_data[(h * len + i) * d..(h * len + i + 1) * d];
            let logits: Vec<f64> = (0..sees)
                .map(|s| {
                    let ks = &k_data[(kvh * keys + s) * d..(kvh * keys + s + 1) * d];
                    qi.iter().zip(ks).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                })
                .collect();
            let top = logits.iter().cloned().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = logits.iter().map(|l| (l - top).exp()).collect();
            let total: f64 = weights.iter().sum();
            for c in 0..d {
                let want: f64 = (0..sees).map(|s| weights[s] / total * v_data[(kvh * keys + s) * d + c] as f64).sum();
                worst = worst.max((got[(h * len + i) * d + c] as f64 - want).abs());
            }
        }
    }
    assert!(worst < 1e-5, "largest difference {worst}");
}

/// A few rows against a weight matrix on the CPU (`x @ W.T`, as every dense layer) are the
/// host's matrix-vector products: each row as the definition, the same bits whether it came
/// alone or with others (batch and solo decode agree), a bias added by addmm; more rows, and
/// a non-float32 input, keep MLX's matmul.
#[test]
fn a_few_rows_times_a_weight_matrix_on_the_cpu_are_row_products_as_the_definition() {
    if Device::default_device() == Device::Gpu {
        return;
    }
    let (n, k) = (37usize, 23usize);
    let values = |len: usize, seed: usize| -> Vec<f32> {
        (0..len).map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 250.0) - 2.0).collect()
    };
    let (w_data, x_data, bias) = (values(n * k, 1), values(3 * k, 2), values(n, 3));
    let w_t = arr(&w_data, &[n, k]).transpose(&[1, 0]).unwrap();
    let x = arr(&x_data, &[3, 1, k]);
    let y = ops::matmul(&x, &w_t).unwrap();
    assert!(graph_dot(&[&y]).contains("HostFewRowsMatmul"), "not the host's product");
    assert_eq!(y.shape(), vec![3, 1, n]);
    let got = y.to_vec_f32().unwrap();
    let mut worst = 0f64;
    for r in 0..3 {
        for o in 0..n {
            let want: f64 = (0..k).map(|i| x_data[r * k + i] as f64 * w_data[o * k + i] as f64).sum();
            worst = worst.max((got[r * n + o] as f64 - want).abs());
        }
    }
    assert!(worst < 1e-4, "largest difference {worst}");
    // The second row alone: the same bits as within the three.
    let alone = ops::matmul(&arr(&x_data[k..2 * k], &[1, 1, k]), &w_t).unwrap().to_vec_f32().unwrap();
    assert_eq!(alone, got[n..2 * n].to_vec());
    // addmm: 2 (x @ W.T) + 0.5 bias.
    let z = ops::addmm(&arr(&bias, &[n]), &x, &w_t, 2.0, 0.5).unwrap();
    assert!(graph_dot(&[&z]).contains("HostFewRowsMatmul"));
    let z = z.to_vec_f32().unwrap();
    for r in 0..3 {
        for o in 0..n {
            let want = 2.0 * got[r * n + o] + 0.5 * bias[o];
            assert!((z[r * n + o] - want).abs() < 1e-4, "row {r} column {o}: {} != {want}", z[r * n + o]);
        }
    }
    // Eight rows are MLX's matmul, the same values to rounding.
    let x8 = arr(&values(8 * k, 4), &[8, k]);
    let many = ops::matmul(&x8, &w_t).unwrap();
    assert!(!graph_dot(&[&many]).contains("HostFewRowsMatmul"));
    let few = ops::matmul(&x8.slice_axis(0, 0, 2).unwrap(), &w_t).unwrap();
    let (many, few) = (many.to_vec_f32().unwrap(), few.to_vec_f32().unwrap());
    assert!(few.iter().zip(&many[..2 * n]).all(|(a, b)| (a - b).abs() < 1e-4));
}

/// The host's CPU product against 4- and 8-bit weights (cpu_qmatmul.cc), with each kernel the
/// CPU has (AVX-512, AVX2, portable C++), against MLX's own quantized matmul: group sizes 32,
/// 64, 128; a few activation rows (packed weights: up to 64 rows in AVX-512's tiles of 4
/// weight rows by up to 2 activation rows, up to 16 in AVX2's passes of 4) and more
/// (dequantized blocks through sgemm); a product large enough to be split over threads. A row's
/// result has the same bits whether it came alone or with the others of a packed product
/// (batch and solo decode agree), and a strided activation gives the contiguous one's result.
/// With each kernel too, bfloat16 products have MLX's bits (`bfloat16_products_have_mlx_s_bits`).
#[test]
fn the_cpu_quantized_product_equals_mlx_s_with_every_kernel() {
    if Device::default_device() == Device::Gpu {
        return;
    }
    // (weight rows, input width, group, bits, activation rows)
    let cases = [
        (37, 96, 32, 4, 1),
        (64, 256, 64, 4, 3),
        (40, 384, 128, 4, 4),
        (33, 160, 32, 8, 5),
        (45, 224, 32, 4, 7),
        (50, 256, 64, 8, 8),
        (29, 192, 32, 4, 9),
        (31, 256, 64, 4, 16),
        (70, 128, 128, 8, 17),
        (26, 128, 32, 4, 33),
        (2048, 576, 32, 4, 2),
        (43, 128, 32, 4, 70),
        (21, 96, 32, 8, 66),
        (19, 128, 32, 4, 130),
    ];
    for isa in [3, 2, 1] {
        // Rows up to which the product is packed (and a row's bits its own).
        let packed = crate::device::cap_cpu_qmatmul_isa(isa) as usize;
        assert!(packed >= 16, "isa {isa}: packed up to {packed} rows");
        for (i, &(rows, input, group, bits, xrows)) in cases.iter().enumerate() {
            let w = arr(&noise(rows * input, i as u64), &[rows, input]);
            let (q, scales, biases) = ops::quantize(&w, group, bits).unwrap();
            let x = arr(&noise(xrows * input, 100 + i as u64), &[xrows, 1, input]);
            let quant = ops::Quant { mode: "affine", group_size: group, bits, biases: Some(&biases) };
            let got = ops::quantized_matmul(&x, &q, &scales, quant, true).unwrap();
            assert!(graph_dot(&[&got]).contains("HostCpuQmatmul"), "case {i}: not the host's product");
            let want = crate::array::wrap(crate::ffi::ffi::quantized_matmul(
                &x.0, &q.0, &scales.0, &biases.0, true, group, bits, "affine", false,
            ))
            .unwrap();
            assert_eq!(got.shape(), vec![xrows, 1, rows]);
            let (got_v, want_v) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
            let scale = want_v.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got_v.iter().zip(&want_v).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
            assert!(err <= 1e-5, "isa {isa} case {i} {:?}: max relative error {err:e}", cases[i]);
            if xrows > 1 && xrows <= packed {
                let last = x.slice_axis(0, xrows as i32 - 1, xrows as i32).unwrap();
                let alone = ops::quantized_matmul(&last, &q, &scales, quant, true).unwrap().to_vec_f32().unwrap();
                assert_eq!(alone, got_v[(xrows - 1) * rows..].to_vec(), "isa {isa} case {i}: alone != in a batch");
            }
        }
        bfloat16_products_have_mlx_s_bits(isa);
        // A strided activation (a transposed view) is read as its values.
        let (rows, input) = (48, 64);
        let w = arr(&noise(rows * input, 9), &[rows, input]);
        let (q, scales, biases) = ops::quantize(&w, 32, 4).unwrap();
        let quant = ops::Quant { mode: "affine", group_size: 32, bits: 4, biases: Some(&biases) };
        let xt = arr(&noise(2 * input, 10), &[input, 2]).transpose(&[1, 0]).unwrap();
        let strided = ops::quantized_matmul(&xt, &q, &scales, quant, true).unwrap().to_vec_f32().unwrap();
        let dense = ops::quantized_matmul(&xt.contiguous().unwrap(), &q, &scales, quant, true).unwrap();
        assert_eq!(strided, dense.to_vec_f32().unwrap(), "isa {isa}: strided activation");
    }
    crate::device::cap_cpu_qmatmul_isa(3);
}

/// A bfloat16 product (an MLX folder in bfloat16 on the CPU) has MLX's bits exactly: the host's
/// kernel in use (`isa`: the_cpu_quantized_product_equals_mlx_s_with_every_kernel runs this
/// with each) rounds after every operation as MLX's scalar one does (tails of fewer than 16
/// weight rows, groups of 32 to 128, 4 and 8 bits, several activation rows, a NaN).
fn bfloat16_products_have_mlx_s_bits(isa: i32) {
    // (weight rows, input width, group, bits, activation rows)
    let cases = [
        (37, 128, 32, 4, 1),
        (64, 256, 64, 4, 3),
        (40, 384, 128, 4, 2),
        (33, 160, 32, 8, 1),
        (50, 256, 64, 8, 5),
        (700, 512, 64, 4, 2),
    ];
    for (i, &(rows, input, group, bits, xrows)) in cases.iter().enumerate() {
        let w = arr(&noise(rows * input, 40 + i as u64), &[rows, input]).astype(Dtype::Bfloat16).unwrap();
        let (q, scales, biases) = ops::quantize(&w, group, bits).unwrap();
        assert_eq!(scales.dtype(), Dtype::Bfloat16);
        let mut xv: Vec<f32> = noise(xrows * input, 140 + i as u64).iter().map(|v| v * 3.0).collect();
        if i == 1 {
            xv[input + 7] = f32::NAN; // the second activation row's outputs are NaN
        }
        let x = arr(&xv, &[xrows, 1, input]).astype(Dtype::Bfloat16).unwrap();
        let quant = ops::Quant { mode: "affine", group_size: group, bits, biases: Some(&biases) };
        let got = ops::quantized_matmul(&x, &q, &scales, quant, true).unwrap();
        assert!(graph_dot(&[&got]).contains("HostCpuQmatmulBf16"), "case {i}: the host's product");
        let want = crate::array::wrap(crate::ffi::ffi::quantized_matmul(
            &x.0, &q.0, &scales.0, &biases.0, true, group, bits, "affine", false,
        ))
        .unwrap();
        assert_eq!(got.dtype(), Dtype::Bfloat16);
        assert_eq!(got.shape(), vec![xrows, 1, rows]);
        let bits_of = |a: &Array| a.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (g, w) = (bits_of(&got), bits_of(&want));
        let differ = g.iter().zip(&w).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "isa {isa} case {i} {:?}: {differ} of {} outputs differ from MLX's", cases[i], g.len());
        if i == 1 {
            assert!(g[rows..2 * rows].iter().all(|&b| f32::from_bits(b).is_nan()), "NaN in, NaN out");
        }
    }
}

/// A mixture of experts' products (`gather_qmm`) on the CPU are the host's: as mlx-lm's
/// SwitchGLU calls it (x `[T, 1, 1, K]`, experts `[T, k]`) and with a prompt's pairs sorted by
/// expert (x `[P, 1, K]`, sorted experts: runs of one expert go through one product). MLX's
/// gather runs its dense kernel per matrix, so each matrix is checked against MLX's dense
/// product of its row and its expert's weights: bfloat16 exactly, float32 within the host's
/// float32 product's bound.
#[test]
fn gathered_quantized_products_are_mlx_s_per_matrix() {
    if Device::default_device() == Device::Gpu {
        return;
    }
    let (experts, n, k, group) = (5usize, 300usize, 192usize, 64); // over 256k multiply-adds: shared out
                                                                   // (x shape, expert picks, their shape, sorted)
    let layouts: [(&[usize], &[u32], &[usize], bool); 2] =
        [(&[3, 1, 1, k], &[4, 1, 0, 4, 2, 2], &[3, 2], false), (&[7, 1, k], &[0, 0, 1, 3, 3, 3, 4], &[7], true)];
    for dtype in [Dtype::Bfloat16, Dtype::Float32] {
        for bits in [4, 8] {
            for (l, &(xshape, picks, ishape, sorted)) in layouts.iter().enumerate() {
                let w = arr(&noise(experts * n * k, 70 + bits as u64), &[experts, n, k]).astype(dtype).unwrap();
                let (q, scales, biases) = ops::quantize(&w, group, bits).unwrap();
                let rows = xshape[0];
                let x = arr(&noise(rows * k, 80 + l as u64), xshape).astype(dtype).unwrap();
                let indices = Array::from_u32(picks, ishape).unwrap();
                let quant = ops::Quant { mode: "affine", group_size: group, bits, biases: Some(&biases) };
                let got = ops::gather_qmm(&x, &q, &scales, quant, &indices, true, sorted).unwrap();
                let name = match dtype {
                    Dtype::Bfloat16 => "HostCpuGatherQmmBf16",
                    _ => "HostCpuGatherQmm",
                };
                let what = format!("{dtype:?}, {bits} bits, layout {l}");
                assert!(graph_dot(&[&got]).contains(name), "{what}: the host's product");
                let got = got.to_vec_f32().unwrap();
                assert_eq!(got.len(), picks.len() * n, "{what}");
                let per_token = picks.len() / rows;
                for (i, &e) in picks.iter().enumerate() {
                    let (t, e) = ((i / per_token) as i32, e as i32);
                    let one = |a: &Array| a.slice_axis(0, e, e + 1).unwrap().squeeze(&[0]).unwrap();
                    let xt = x.slice_axis(0, t, t + 1).unwrap().reshape(&[1, k as i32]).unwrap();
                    let want = crate::array::wrap(crate::ffi::ffi::quantized_matmul(
                        &xt.0,
                        &one(&q).0,
                        &one(&scales).0,
                        &one(&biases).0,
                        true,
                        group,
                        bits,
                        "affine",
                        false,
                    ))
                    .unwrap()
                    .to_vec_f32()
                    .unwrap();
                    let mine = &got[i * n..(i + 1) * n];
                    if dtype == Dtype::Bfloat16 {
                        let same = mine.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{what}, token {t}, expert {e}: differs from MLX's product");
                    } else {
                        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let err = mine.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                        assert!(err <= 1e-5, "{what}, token {t}, expert {e}: relative error {err:e}");
                    }
                }
            }
        }
    }
}

/// The chunked gated delta rule is the step-by-step one: over 150 positions (chunks of 64
/// and 16, the last one padded) from a held state, with keys that point nearly the same way
/// (the chunk's triangular system far from the identity), writes near full strength and
/// decays from none to strong, the outputs and the final state agree to float32 rounding.
#[test]
fn chunked_gated_delta_equals_the_step_by_step_rule() {
    let (b, t, h, dk, dv) = (2usize, 150usize, 3usize, 16usize, 8usize);
    let mut seed = 0x2545f4914f6cdd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    // Unit keys around one direction per head; queries of norm Dk^-0.5, as the model scales them.
    let base: Vec<f32> = (0..h * dk).map(|_| next()).collect();
    let mut unit = |scale: f32, spread: f32| -> Vec<f32> {
        let mut out = Vec::with_capacity(b * t * h * dk);
        for _ in 0..b * t {
            for head in 0..h {
                let row: Vec<f32> = (0..dk).map(|i| base[head * dk + i] + spread * next()).collect();
                let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
                out.extend(row.iter().map(|x| x / norm * scale));
            }
        }
        out
    };
    let k = unit(1.0, 0.3);
    let q = unit((dk as f32).powf(-0.5), 1.0);
    let mut next_vec = |n: usize, f: &dyn Fn(f32) -> f32| -> Vec<f32> { (0..n).map(|_| f(next())).collect() };
    let v = next_vec(b * t * h * dv, &|x| x);
    let beta = next_vec(b * t * h, &|x| 0.6 + 0.4 * x.abs());
    let log_g = next_vec(b * t * h, &|x| -2.0 * x * x);
    let state0 = next_vec(b * h * dv * dk, &|x| x);
    let q = arr(&q, &[b, t, h, dk]);
    let k = arr(&k, &[b, t, h, dk]);
    let v = arr(&v, &[b, t, h, dv]);
    let beta = arr(&beta, &[b, t, h]);
    let log_g = arr(&log_g, &[b, t, h]);
    let state0 = arr(&state0, &[b, h, dv, dk]);

    let g = log_g.exp().unwrap();
    let at = |a: &Array, i: i32| a.slice_axis(1, i, i + 1).unwrap().squeeze(&[1]).unwrap();
    // The step rule over every position: (outputs [B, T, H, Dv], final state).
    let stepped = |q: &Array, k: &Array, v: &Array, beta: &Array| -> (Array, Array) {
        let mut state = state0.clone();
        let mut ys = Vec::new();
        for i in 0..t as i32 {
            let (y, s) =
                ops::gated_delta_step(&at(q, i), &at(k, i), &at(v, i), &at(&g, i), &at(beta, i), &state).unwrap();
            ys.push(y.expand_dims(&[1]).unwrap());
            state = s;
        }
        (ops::concatenate(&ys.iter().collect::<Vec<_>>(), 1).unwrap(), state)
    };
    let (want_y, want_s) = stepped(&q, &k, &v, &beta);
    let (want_y, want_s) = (want_y.to_vec_f32().unwrap(), want_s.to_vec_f32().unwrap());
    let close = |got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        let diff = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-5 * scale.max(10.0), "{what}: max diff {diff} (largest value {scale})");
    };
    for chunk in [64, 16] {
        let (y, s) = ops::gated_delta_chunked(&q, &k, &v, &log_g, &beta, &state0, chunk).unwrap();
        assert_eq!(y.shape(), vec![b, t, h, dv]);
        close(&y.to_vec_f32().unwrap(), &want_y, &format!("outputs, chunks of {chunk}"));
        close(&s.to_vec_f32().unwrap(), &want_s, &format!("final state, chunks of {chunk}"));
    }
    assert!(ops::gated_delta_chunked(&q, &k, &v, &log_g, &beta, &state0, 48).is_err(), "48 is not a power of two");

    // A bfloat16 model's inputs (the state stays float32 either way): the same state to
    // float32 rounding, the outputs (bfloat16, as the step gives them) to a bfloat16 step.
    let bf = |a: &Array| a.astype(Dtype::Bfloat16).unwrap();
    let (q, k, v, beta) = (bf(&q), bf(&k), bf(&v), bf(&beta));
    let (want_y, state) = stepped(&q, &k, &v, &beta);
    assert_eq!(want_y.dtype(), Dtype::Bfloat16);
    let (y, s) = ops::gated_delta_chunked(&q, &k, &v, &log_g, &beta, &state0, 64).unwrap();
    assert_eq!(y.dtype(), Dtype::Bfloat16);
    close(&s.to_vec_f32().unwrap(), &state.to_vec_f32().unwrap(), "final state, bfloat16 inputs");
    let (got, want) = (y.astype(Dtype::Float32).unwrap(), want_y.astype(Dtype::Float32).unwrap());
    let diff =
        got.to_vec_f32().unwrap().iter().zip(want.to_vec_f32().unwrap()).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff <= 1.0 / 128.0, "bfloat16 outputs differ by {diff}");
}

/// The host's CPU SwiGLU and log-sum-exp (AVX-512, AVX2, and their scalar fallbacks) give MLX's
/// kernels' bits. SwiGLU over a sweep of gates from -100 to 100 (exp's cut-offs at +-88, the
/// half-way points of its rounding), zeros of both signs, infinities, NaN and subnormals, a
/// length that is not a multiple of sixteen, and the halves of a fused gate/up projection read
/// in place (rows strided in memory). Log-sum-exp over vocabulary-sized rows: logits, masked
/// ones (-inf), all masked, one NaN, huge values, and a column of a matrix (a strided row);
/// softmax over the same rows and over short ones.
#[test]
#[allow(clippy::approx_constant)] // 1.442695 is MLX's own rounding of log2(e), on purpose
fn cpu_exp_kernels_are_mlxs_bit_for_bit() {
    let mut gates: Vec<f32> = (0..40_000).map(|i| -100.0 + i as f32 * 0.005).collect();
    gates.extend([0.0, -0.0, 88.0, -88.0, 88.00001, -88.00001, 61.0, -61.0, f32::INFINITY, f32::NEG_INFINITY]);
    gates.extend([f32::NAN, 1e-40, -1e-40, f32::MIN_POSITIVE, 0.5 / std::f32::consts::LOG2_E]);
    // Every float around the gates whose |g| * log2(e) is just under 0.5, 1.5, 3.5, ...: there
    // a float sum x + 0.5 rounds up to the next power of two where MLX's exact one does not.
    for t in [0.5f32, 1.5, 3.5, 7.5, 15.5, 31.5, 63.5] {
        let mid = (t / 1.442_695f32).to_bits();
        gates.extend((mid - 600..mid + 600).map(f32::from_bits).flat_map(|g| [g, -g]));
    }
    let n = gates.len();
    let xs: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 97.0).collect();
    let (g, x) = (arr(&gates, &[n]), arr(&xs, &[n]));
    // A fused projection [rows, 2F]: gate the first half of each row, x the second.
    let (rows, f) = (8usize, 1537usize);
    let fused: Vec<f32> = (0..rows * 2 * f).map(|i| gates[i % n] * if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
    let fused = arr(&fused, &[rows, 2 * f]);
    let (fg, fx) = (fused.slice_axis(1, 0, f as i32).unwrap(), fused.slice_axis(1, f as i32, 2 * f as i32).unwrap());
    let run = |mode: i32| -> (Vec<f32>, Vec<f32>) {
        crate::device::set_cpu_exp_mode(mode);
        let a = ops::swiglu(&g, &x).unwrap().to_vec_f32().unwrap();
        let b = ops::swiglu(&fg, &fx).unwrap().to_vec_f32().unwrap();
        (a, b)
    };
    // Log-sum-exp rows of 49,157 (not a multiple of sixteen).
    let m = 49_157usize;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    // One logit at 0 and the rest far below: a sum near 1 whose log shows its last bits.
    rows.push((0..m).map(|i| if i == 777 { 0.0 } else { -12.0 + xs[i % n] / 10.0 }).collect());
    rows.push((0..m).map(|i| if i % 5 == 0 { f32::NEG_INFINITY } else { xs[i % n] * 3.0 }).collect());
    rows.push(vec![f32::NEG_INFINITY; m]);
    rows.push((0..m).map(|i| if i == 30_001 { f32::NAN } else { xs[i % n] }).collect());
    rows.push((0..m).map(|i| 1e30 + xs[i % n]).collect());
    let flat: Vec<f32> = rows.concat();
    let logits = arr(&flat, &[rows.len(), m]);
    let column = logits.slice_axis(1, 0, 1000).unwrap().transpose(&[1, 0]).unwrap();
    let lse = |mode: i32| -> Vec<f32> {
        crate::device::set_cpu_exp_mode(mode);
        let a = logits.logsumexp(&[-1], false).unwrap().to_vec_f32().unwrap();
        let b = column.logsumexp(&[-1], true).unwrap().to_vec_f32().unwrap();
        // Softmax of the same rows (the last two: attention's and a sampler's), and of a
        // [2, 3, 37] block of them (rows not a multiple of sixteen long).
        let c = logits.softmax(&[-1], true).unwrap().to_vec_f32().unwrap();
        let d = column.softmax(&[-1], true).unwrap().to_vec_f32().unwrap();
        let block = Array::from_f32(&flat[..2 * 3 * 37], &[2, 3, 37]).unwrap();
        let e = block.softmax(&[-1], true).unwrap().to_vec_f32().unwrap();
        [a, b, c, d, e].concat()
    };
    let want = lse(0);
    assert!(want[2] == f32::NEG_INFINITY && want[3].is_nan(), "{:?}", &want[..5]);
    for mode in [1, 2, 3] {
        let got = lse(mode);
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "mode {mode}, log-sum-exp or softmax value {i}: {a:e} against MLX's {b:e}"
            );
        }
    }

    let mlx = run(0);
    for mode in [1, 2, 3] {
        let host = run(mode);
        for (what, got, want) in [("sweep", &host.0, &mlx.0), ("fused halves", &host.1, &mlx.1)] {
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "mode {mode}, {what}[{i}]: {a:e} against MLX's {b:e}"
                );
            }
        }
    }
    crate::device::set_cpu_exp_mode(2);
}

/// The host's CPU RMSNorm and rotary embedding (one primitive each, `cpu_exp.cc`) give the bits
/// of MLX's own CPU graphs for them (the `fast::` fallbacks of a dozen and some thirty
/// primitives). RMSNorm: rows of SmolLM2's width and odd ones, with and without a weight, a
/// strided view (a column block), huge and tiny values. RoPE: decode and prefill shapes, a
/// transposed view (q from a fused projection), every dims form (whole head, partial), both
/// layouts, base and explicit frequencies, scalar offsets and one per row far into a long
/// context (where cos and sin reduce large arguments), and a 3-D input.
#[test]
fn cpu_rms_norm_and_rope_are_mlxs_bit_for_bit() {
    let values = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 20_011) as f32 - 10_005.0) / 1_733.0).collect()
    };
    let check = |what: &str, run: &dyn Fn() -> Vec<f32>| {
        crate::device::set_cpu_exp_mode(0);
        let want = run();
        crate::device::set_cpu_exp_mode(2);
        let got = run();
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(a.to_bits() == b.to_bits(), "{what}[{i}]: {a:e} against MLX's {b:e}");
        }
    };
    // RMSNorm.
    let w = arr(&values(576, 3).iter().map(|v| 1.0 + v / 10.0).collect::<Vec<_>>(), &[576]);
    let mut big = values(8 * 576, 1);
    big[5] = 3.0e18;
    big[600] = 1.0e-30;
    let x = arr(&big, &[8, 576]);
    let wide = arr(&values(3 * 1200, 2), &[3, 1200]);
    let block = wide.slice_axis(1, 100, 676).unwrap();
    let odd = arr(&values(2 * 3 * 37, 4), &[2, 3, 37]);
    check("rms_norm", &|| fast::rms_norm(&x, &w, 1e-5).unwrap().to_vec_f32().unwrap());
    check("rms_norm of a view", &|| fast::rms_norm(&block, &w, 1e-6).unwrap().to_vec_f32().unwrap());
    check("rms_norm without a weight", &|| fast::rms_norm_plain(&odd, 1e-6).unwrap().to_vec_f32().unwrap());
    // RoPE: [B, H, T, D] from [B, T, H, D] (a view), offsets per row.
    let (b, h, t, d) = (4usize, 3usize, 5usize, 64usize);
    let q = arr(&values(b * t * h * d, 5), &[b, t, h, d]).transpose(&[0, 2, 1, 3]).unwrap();
    let offsets = Array::from_i32(&[0, 17, 4_093, 70_001], &[b]).unwrap();
    let freqs = arr(&(0..16).map(|i| 1.0 + i as f32 * 37.5).collect::<Vec<_>>(), &[16]);
    let flat = arr(&values(2 * 7 * 128, 6), &[2, 7, 128]);
    for (dims, traditional) in [(64, false), (64, true), (32, false), (32, true)] {
        let what = format!("rope dims {dims} traditional {traditional}");
        check(&what, &|| fast::rope(&q, dims, traditional, 10_000.0, 1.0, 1_000).unwrap().to_vec_f32().unwrap());
        check(&what, &|| {
            fast::rope_rows(&q, dims, traditional, 500_000.0, 0.25, &offsets).unwrap().to_vec_f32().unwrap()
        });
        check(&what, &|| fast::rope(&flat, dims, traditional, 10_000.0, 1.0, 3).unwrap().to_vec_f32().unwrap());
    }
    check("rope with freqs", &|| fast::rope_with_freqs(&q, 32, false, 1.0, 12, &freqs).unwrap().to_vec_f32().unwrap());
    check("rope rows with freqs", &|| {
        fast::rope_rows_with_freqs(&q, 32, false, 1.0, &offsets, &freqs).unwrap().to_vec_f32().unwrap()
    });
    // The host's kernels did run: one node each where MLX builds many.
    let graph = |y: &Array| crate::device::graph_dot(&[y]);
    crate::device::set_cpu_exp_mode(2);
    let (norm, rope) =
        (fast::rms_norm(&x, &w, 1e-5).unwrap(), fast::rope_rows(&q, 64, false, 1e4, 1.0, &offsets).unwrap());
    assert!(graph(&norm).contains("HostCpuRmsNorm") && graph(&rope).contains("HostCpuRope"));
    crate::device::set_cpu_exp_mode(0);
    let (norm, rope) =
        (fast::rms_norm(&x, &w, 1e-5).unwrap(), fast::rope_rows(&q, 64, false, 1e4, 1.0, &offsets).unwrap());
    assert!(graph(&norm).contains("Rsqrt") && graph(&rope).contains("Cos"));
    crate::device::set_cpu_exp_mode(2);
}
