use crate::testing;
use crate::{load, CausalLm, Error, KvCache, Tokenizer};
use mlx::{Array, Dtype};
use serde_json::json;
use std::path::{Path, PathBuf};

const ARCHS: [&str; 9] =
    ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gemma3_text", "gpt_oss", "phi3", "ministral3"];

fn tokens(ids: &[i32]) -> Array {
    Array::from_i32(ids, &[1, ids.len()]).unwrap()
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Logits of each position, decoding `ids` in pieces of the given sizes through one cache.
fn decode_in_pieces(model: &dyn CausalLm, ids: &[i32], pieces: &[usize]) -> (Array, Vec<KvCache>) {
    let mut cache = model.make_cache();
    let mut outs = Vec::new();
    let mut start = 0;
    for &len in pieces {
        outs.push(model.forward(&tokens(&ids[start..start + len]), &mut cache).unwrap());
        start += len;
    }
    assert_eq!(start, ids.len());
    let refs: Vec<&Array> = outs.iter().collect();
    (mlx::ops::concatenate(&refs, 1).unwrap(), cache)
}

fn prompt(n: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 37 + 11) % testing::VOCAB) as i32).collect()
}

#[test]
fn token_by_token_decoding_with_the_cache_equals_one_full_forward() {
    for arch in ARCHS {
        let model = testing::model(arch, 1).unwrap();
        let ids = prompt(12);
        let (full, _) = decode_in_pieces(model.as_ref(), &ids, &[12]);
        let (stepped, cache) = decode_in_pieces(model.as_ref(), &ids, &[1; 12]);
        assert_eq!(full.shape(), vec![1, 12, testing::VOCAB]);
        assert_eq!(cache[0].offset(), 12);
        let d = max_abs_diff(&full, &stepped);
        assert!(d < 1e-4, "{arch}: max diff {d}");
    }
}

#[test]
fn chunked_prefill_across_the_cache_growth_step_equals_one_pass() {
    // 300 positions cross the cache's 256-position allocation step.
    for arch in ARCHS {
        let model = testing::model(arch, 2).unwrap();
        let ids = prompt(300);
        let (full, _) = decode_in_pieces(model.as_ref(), &ids, &[300]);
        let (chunked, cache) = decode_in_pieces(model.as_ref(), &ids, &[100, 155, 3, 41, 1]);
        assert_eq!(cache[1].offset(), 300);
        let d = max_abs_diff(&full, &chunked);
        assert!(d < 1e-4, "{arch}: max diff {d}");
    }
}

#[test]
fn trim_then_redecode_equals_the_untrimmed_run() {
    for arch in ARCHS {
        let model = testing::model(arch, 3).unwrap();
        let ids = prompt(20);
        let (reference, _) = decode_in_pieces(model.as_ref(), &ids, &[20]);
        // Decode 15 positions with wrong tokens at 10..15, trim them, decode the right ones.
        let mut cache = model.make_cache();
        model.forward(&tokens(&ids[..10]), &mut cache).unwrap();
        model.forward(&tokens(&[5, 6, 7, 8, 9]), &mut cache).unwrap();
        for c in cache.iter_mut() {
            assert_eq!(c.trim(5), 5);
        }
        assert_eq!(cache[0].offset(), 10);
        let tail = model.forward(&tokens(&ids[10..]), &mut cache).unwrap();
        let expected = reference.slice_axis(1, 10, 20).unwrap();
        let d = max_abs_diff(&expected, &tail);
        assert!(d < 1e-4, "{arch}: max diff {d}");
    }
}

#[test]
fn a_forked_batch_scores_rows_over_the_prefix_and_an_adopted_row_continues_the_cache() {
    // 250 cached positions, then three 8-token continuations as one batch over a fork: each
    // row's logits are the single-row forward's; adopting row 1 (crossing the 256-position
    // allocation step) leaves the cache as if row 1 had been decoded directly, and the
    // original cache is untouched by the fork.
    for arch in ARCHS {
        let model = testing::model(arch, 4).unwrap();
        let ids = prompt(250);
        let rows: Vec<Vec<i32>> = (0..3).map(|r| (0..8).map(|i| (r * 31 + i * 7 + 3) % 100).collect()).collect();
        let mut cache = model.make_cache();
        model.forward(&tokens(&ids), &mut cache).unwrap();
        let mut forks: Vec<KvCache> = cache.iter().map(|c| c.fork_batch(3).unwrap()).collect();
        let flat: Vec<i32> = rows.concat();
        let batch = model.forward(&Array::from_i32(&flat, &[3, 8]).unwrap(), &mut forks).unwrap();
        assert_eq!(cache[0].offset(), 250, "the fork leaves the cache alone");
        for (r, row) in rows.iter().enumerate() {
            let whole: Vec<i32> = ids.iter().chain(row).copied().collect();
            let (direct, _) = decode_in_pieces(model.as_ref(), &whole, &[250, 8]);
            let d = max_abs_diff(
                &direct.slice_axis(1, 250, 258).unwrap(),
                &batch.slice_axis(0, r as i32, r as i32 + 1).unwrap(),
            );
            assert!(d < 1e-4, "{arch} row {r}: max diff {d}");
        }
        for (c, f) in cache.iter_mut().zip(&forks) {
            c.adopt_row(f, 1, 8).unwrap();
        }
        assert_eq!(cache[0].offset(), 258);
        let next = model.forward(&tokens(&[42]), &mut cache).unwrap();
        let whole: Vec<i32> = ids.iter().chain(&rows[1]).chain(&[42]).copied().collect();
        let (direct, _) = decode_in_pieces(model.as_ref(), &whole, &[258, 1]);
        let d = max_abs_diff(&direct.slice_axis(1, 258, 259).unwrap(), &next);
        assert!(d < 1e-4, "{arch}: after adopting row 1, max diff {d}");
        let err = cache[0].adopt_row(&forks[0], 3, 1).unwrap_err().to_string();
        assert!(err.contains("row 3"), "{err}");
    }
}

/// With every layer sliding (window 8, two layers: a receptive field of 14 positions), the
/// last position's logits do not depend on a token 19 positions back, and do on one 13 back.
#[test]
fn gemma3_sliding_layers_see_only_their_window() {
    let mut config = testing::config("gemma3_text");
    config["sliding_window_pattern"] = json!(10);
    let arch = crate::Arch::parse(&config, Path::new("<tiny random>")).unwrap();
    let mut w =
        crate::weights::Weights::new(testing::weights("gemma3_text", 5).unwrap(), Path::new("<t>"), "gemma3_text");
    let model = arch.model(&mut w, &Default::default()).unwrap();
    let ids = prompt(20);
    let last = |ids: &[i32]| decode_in_pieces(model.as_ref(), ids, &[ids.len()]).0.slice_axis(1, 19, 20).unwrap();
    let mut far = ids.clone();
    far[0] = (far[0] + 1) % testing::VOCAB as i32;
    assert_eq!(max_abs_diff(&last(&ids), &last(&far)), 0.0, "a token outside the window changed the logits");
    let mut near = ids.clone();
    near[6] = (near[6] + 1) % testing::VOCAB as i32;
    assert!(max_abs_diff(&last(&ids), &last(&near)) > 1e-3, "a token inside the window changed nothing");
    // Decoding step by step (each step slicing the cache to the window) agrees.
    let (stepped, _) = decode_in_pieces(model.as_ref(), &far, &[1; 20]);
    assert!(max_abs_diff(&stepped.slice_axis(1, 19, 20).unwrap(), &last(&ids)) < 1e-4);
}

/// A sparse MoE layer equals its definition computed densely: every expert's SwiGLU MLP over
/// every token, weighted by the token's softmax weight (renormalized over the top 2 for
/// Qwen3-MoE, as is for Qwen2-MoE) where the expert is among its top 2 by router score and by
/// 0 elsewhere, plus Qwen2-MoE's shared expert scaled by its sigmoid gate — both for few
/// tokens (experts gathered per token) and for many (tokens sorted by expert first, from 64
/// (token, expert) pairs).
#[test]
fn a_moe_layer_equals_the_dense_weighted_sum_of_its_top_k_experts() {
    for arch in ["qwen3_moe", "qwen2_moe"] {
        moe_layer_equals_its_dense_definition(arch);
    }
}

fn moe_layer_equals_its_dense_definition(arch: &str) {
    let mut w = crate::weights::Weights::new(testing::weights(arch, 6).unwrap(), Path::new("<t>"), arch);
    let p = "model.layers.0.mlp";
    let (experts, ffn, renormalize) = (4, 32, arch == "qwen3_moe");
    crate::moe::stack_experts(&mut w, p, experts).unwrap();
    let dims = crate::moe::MoeDims::qwen(experts, 2, ffn, renormalize, vec![true]);
    // Qwen2-MoE's shared expert: the decoder's MLP at width 128 (the tiny dense width).
    let shared = (arch == "qwen2_moe").then(|| {
        let d: crate::llama::Config = serde_json::from_value(testing::config("llama")).unwrap();
        let tp = crate::llama::Tp::of(&Default::default());
        let mlp =
            crate::llama::Mlp::load(&w, &format!("{p}.shared_expert"), &d.dims(), crate::llama::Activation::Silu, tp);
        Box::new(mlp.unwrap()) as Box<dyn crate::layers::Forward>
    });
    let has_shared = shared.is_some();
    let moe = crate::moe::SparseMoe::load(&w, p, 64, &dims, shared).unwrap();
    let lin = |a: &Array, m: &Array| mlx::ops::matmul(a, &m.transpose(&[1, 0]).unwrap()).unwrap();
    for n in [3, 40] {
        let key = mlx::random::key(n as u64).unwrap();
        let x = mlx::random::uniform(&[1, n, 64], &key).unwrap();
        let got = moe.forward(&x).unwrap();
        // The router's weights and each token's top 2 (from a full sort, not a partition).
        let gate = w.get(&format!("{p}.gate.weight")).unwrap();
        let probs = mlx::ops::matmul(&x, &gate.transpose(&[1, 0]).unwrap()).unwrap().softmax(&[-1], true).unwrap();
        let probs = probs.reshape(&[-1]).unwrap().to_vec_f32().unwrap();
        let mut weight = vec![0f32; n as usize * experts];
        for t in 0..n as usize {
            let row = &probs[t * experts..(t + 1) * experts];
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let total = if renormalize { row[order[0]] + row[order[1]] } else { 1.0 };
            for &e in &order[..2] {
                weight[t * experts + e] = row[e] / total;
            }
        }
        let stacked = |name: &str| w.get(&format!("{p}.switch_mlp.{name}.weight")).unwrap();
        let mut want = Array::zeros(&[1, n as usize, 64], Dtype::Float32).unwrap();
        for e in 0..experts as i32 {
            let m = |name: &str| {
                stacked(name).slice_axis(0, e, e + 1).unwrap().reshape(&[-1, stacked(name).dim(2) as i32]).unwrap()
            };
            let y =
                lin(&mlx::ops::swiglu(&lin(&x, &m("gate_proj")), &lin(&x, &m("up_proj"))).unwrap(), &m("down_proj"));
            let we: Vec<f32> = (0..n as usize).map(|t| weight[t * experts + e as usize]).collect();
            let we = Array::from_f32(&we, &[1, n as usize, 1]).unwrap();
            want = want.add(&y.multiply(&we).unwrap()).unwrap();
        }
        if has_shared {
            let s = |name: &str| w.get(&format!("{p}.shared_expert.{name}.weight")).unwrap();
            let y =
                lin(&mlx::ops::swiglu(&lin(&x, &s("gate_proj")), &lin(&x, &s("up_proj"))).unwrap(), &s("down_proj"));
            let gate = lin(&x, &w.get(&format!("{p}.shared_expert_gate.weight")).unwrap()).sigmoid().unwrap();
            want = want.add(&y.multiply(&gate).unwrap()).unwrap();
        }
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-5, "{arch}, {n} tokens: max diff {d}");
    }
}

/// Tensor parallelism is refused for a mixture of experts before any rank starts.
#[test]
fn tensor_parallelism_over_a_moe_model_is_refused() {
    let dir = write_model("moe-tp", "qwen3_moe");
    let err = crate::check_tensor_parallel(&dir, 2).unwrap_err().to_string();
    assert!(err.contains("mixture-of-experts") && err.contains("one rank"), "{err}");
    crate::check_tensor_parallel(&dir, 1).unwrap();
}

/// A sliding window of 0 is refused at load with the key named, for every architecture
/// with sliding layers.
#[test]
fn a_zero_sliding_window_is_refused() {
    for arch in SLIDING {
        let mut config = testing::config(arch);
        config["sliding_window"] = json!(0);
        let parsed = crate::Arch::parse(&config, Path::new("<tiny random>"));
        let err = match parsed {
            Err(e) => e.to_string(),
            Ok(a) => {
                let mut w = crate::weights::Weights::new(testing::weights(arch, 5).unwrap(), Path::new("<t>"), arch);
                a.model(&mut w, &Default::default()).err().expect("a window of 0 loaded").to_string()
            }
        };
        assert!(err.contains("sliding_window is 0"), "{arch}: {err}");
    }
}

#[test]
fn trim_never_goes_below_zero() {
    let mut c = KvCache::default();
    assert_eq!(c.trim(3), 0);
    assert_eq!(c.offset(), 0);
}

// ---- loading and its errors ----

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("models-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn byte_tokenizer() -> Tokenizer {
    let bytes = serde_json::to_vec(&testing::byte_tokenizer_json()).unwrap();
    Tokenizer::from_parts(&bytes, &json!({"chat_template": testing::CHATML, "eos_token": "<|im_end|>"})).unwrap()
}

fn write_model(name: &str, model_type: &str) -> PathBuf {
    let dir = temp_dir(name);
    testing::write_model(&dir, model_type, 9).unwrap();
    dir
}

fn testing_weights_with_vocab(model_type: &str) -> Vec<(String, Array)> {
    testing::weights_with_vocab(model_type, 9, testing::BYTE_VOCAB).unwrap().into_iter().collect()
}

fn load_err(dir: &Path) -> String {
    match load(dir) {
        Ok(_) => panic!("{} loaded but should not have", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_complete_folder_loads_with_its_tokenizer_and_eos() {
    let dir = write_model("ok", "qwen2");
    let loaded = load(&dir).unwrap();
    assert_eq!(loaded.info.model_type, "qwen2");
    assert_eq!(loaded.info.eos_token_ids, vec![1]);
    assert_eq!(loaded.info.vocab_size, 258);
    let ids = loaded.tokenizer.encode_chat(&json!([{"role": "user", "content": "hi"}]), None, true).unwrap();
    assert_eq!(ids[0], 0, "the template's <|im_start|> is a special token");
    let logits = loaded
        .model
        .forward(&tokens(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>()), &mut loaded.model.make_cache())
        .unwrap();
    assert_eq!(logits.shape(), vec![1, ids.len(), 258]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_missing_config_key_names_the_key_and_the_file() {
    let dir = write_model("missing-key", "llama");
    let mut config = testing::config("llama");
    config.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("config.json") && err.contains("missing field `hidden_size`"), "{err}");
}

/// A vision-language folder's config is its text model's, with the wrapper's defaults, the
/// folder's quantization (module names renamed as the weights are) and token ids; its
/// weights lose the `language_model.` prefixes and the vision tower.
#[test]
fn a_vision_language_folder_reads_as_its_text_model() {
    use crate::loader::{text_model_config, text_weight_name};
    let gemma = json!({"model_type": "gemma3", "vocab_size": 1000, "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 64, "model_type": "gemma3_text"},
        "quantization": {"group_size": 64, "bits": 4, "language_model.model.layers.0.mlp.gate_proj": {"group_size": 64, "bits": 8},
            "vision_tower.x": {"group_size": 64, "bits": 8}}});
    let (text, wrapped) = text_model_config(gemma);
    assert!(wrapped);
    assert_eq!((text["model_type"].as_str(), text["vocab_size"].as_u64()), (Some("gemma3_text"), Some(1000)));
    assert_eq!((text["num_attention_heads"].as_u64(), text["num_key_value_heads"].as_u64()), (Some(8), Some(4)));
    assert_eq!(text["eos_token_id"], json!([1, 106]));
    let q = &text["quantization"];
    assert_eq!(q["model.layers.0.mlp.gate_proj"]["bits"], 8);
    assert!(q.get("vision_tower.x").is_some() && q["bits"] == 4, "{q}");
    let (mistral, _) = text_model_config(json!({"model_type": "mistral3", "text_config": {"model_type": "mistral"}}));
    assert_eq!(
        (mistral["model_type"].as_str(), mistral["tie_word_embeddings"].as_bool()),
        (Some("llama"), Some(false))
    );
    let (ministral, _) =
        text_model_config(json!({"model_type": "mistral3", "text_config": {"model_type": "ministral3"}}));
    assert_eq!(ministral["model_type"], "ministral3");
    // A text model's own config is left alone.
    let plain = json!({"model_type": "gemma3_text", "text_config": {"model_type": "x"}});
    assert_eq!(text_model_config(plain.clone()), (plain, false));
    assert_eq!(text_weight_name("language_model.model.norm.weight").as_deref(), Some("model.norm.weight"));
    assert_eq!(text_weight_name("model.language_model.layers.0.q.weight").as_deref(), Some("model.layers.0.q.weight"));
    assert_eq!(text_weight_name("language_model.lm_head.weight").as_deref(), Some("lm_head.weight"));
    assert_eq!(text_weight_name("vision_tower.encoder.w"), None);
    assert_eq!(text_weight_name("model.multi_modal_projector.w"), None);
}

/// A quantization mode MLX does not have is refused, naming the ones it has.
#[test]
fn an_unknown_quantization_mode_is_refused_with_the_supported_ones() {
    let dir = write_model("bad-quant-mode", "llama");
    let mut config = testing::config("llama");
    config["quantization"] = json!({"group_size": 32, "bits": 4, "mode": "int3"});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("\"int3\" is not supported") && err.contains("affine, mxfp4, mxfp8, nvfp4"), "{err}");
}

#[test]
fn an_unknown_model_type_lists_the_supported_ones() {
    let dir = write_model("unknown-type", "llama");
    let mut config = testing::config("llama");
    config["model_type"] = json!("mamba");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_err(&dir);
    assert!(
        err.contains("unsupported model_type \"mamba\"")
            && err.contains("llama, mistral, ministral3, qwen2, qwen2_moe, qwen3"),
        "{err}"
    );
}

#[test]
fn a_truncated_safetensors_file_is_refused_at_load() {
    let dir = write_model("truncated", "llama");
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(len - 1000).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("model.safetensors") && err.contains("truncated"), "{err}");
    // A header that is not JSON.
    std::fs::write(&path, [10, 0, 0, 0, 0, 0, 0, 0, b'{', b'x', b' ', b' ', b' ', b' ', b' ', b' ', b' ', b' '])
        .unwrap();
    let err = load_err(&dir);
    assert!(err.contains("header is not valid JSON"), "{err}");
}

#[test]
fn a_wrongly_shaped_weight_names_the_weight_and_the_expected_shape() {
    // Wrong output rows (up_proj) and a wrong input width (k_proj): both parts of projections
    // that loading fuses; the error still names the checkpoint's own weight.
    for (bad, cols) in
        [("model.layers.1.mlp.up_proj.weight", None), ("model.layers.0.self_attn.k_proj.weight", Some(32))]
    {
        let dir = write_model("bad-shape", "llama");
        let mut weights = testing_weights_with_vocab("llama");
        let mut want = String::new();
        for (name, a) in weights.iter_mut() {
            if name == bad {
                let rows = a.dim(0);
                let shape = match cols {
                    None => [64, 64],
                    Some(c) => [rows, c],
                };
                want = format!("{:?}, expected [{}, 64]", shape, if cols.is_none() { 128 } else { rows });
                *a = Array::zeros(&shape, Dtype::Float32).unwrap();
            }
        }
        let refs: Vec<(&str, &Array)> = weights.iter().map(|(k, v)| (k.as_str(), v)).collect();
        mlx::io::save_safetensors(&dir.join("model.safetensors"), &refs).unwrap();
        let err = load_err(&dir);
        assert!(err.contains(&format!("\"{bad}\"")) && err.contains(&want), "{err}");
    }
}

#[test]
fn a_missing_weight_names_it() {
    let dir = write_model("missing-weight", "qwen3");
    let weights: Vec<(String, Array)> = testing_weights_with_vocab("qwen3")
        .into_iter()
        .filter(|(n, _)| n != "model.layers.0.self_attn.k_norm.weight")
        .collect();
    let refs: Vec<(&str, &Array)> = weights.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_safetensors(&dir.join("model.safetensors"), &refs).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("\"model.layers.0.self_attn.k_norm.weight\" not found") && err.contains("qwen3"), "{err}");
}

#[test]
fn non_utf8_prompt_bytes_are_refused_with_the_offset() {
    let err = byte_tokenizer().encode_bytes(b"caf\xc3(", true).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)));
    assert!(err.to_string().contains("not valid UTF-8") && err.to_string().contains("offset 3"), "{err}");
}

// ---- tokenizer ----

#[test]
fn the_chat_template_renders_with_huggingface_semantics() {
    let tok = byte_tokenizer();
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let text = tok.apply_chat_template(&messages, None, true, None).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // Python string methods and raise_exception work as in transformers.
    let template = "{% if messages[0]['content'].strip().startswith('x') %}{{ raise_exception('no x') }}{% endif %}{{ messages[0]['content'].upper() }}";
    let bytes = serde_json::to_vec(&testing::byte_tokenizer_json()).unwrap();
    let tok = Tokenizer::from_parts(&bytes, &json!({"chat_template": template})).unwrap();
    assert_eq!(
        tok.apply_chat_template(&json!([{"role": "user", "content": " ab "}]), None, false, None).unwrap(),
        " AB "
    );
    let err = tok.apply_chat_template(&json!([{"role": "user", "content": " xy"}]), None, false, None).unwrap_err();
    assert!(err.to_string().contains("no x"), "{err}");
}

#[test]
fn the_detokenizer_holds_back_incomplete_utf8() {
    let tok = byte_tokenizer();
    let ids = tok.encode("é!", false).unwrap();
    assert_eq!(ids.len(), 3, "é is two byte tokens");
    let mut d = crate::Detokenizer::new(&tok);
    assert_eq!(d.push(ids[0]).unwrap(), "");
    assert_eq!(d.push(ids[1]).unwrap(), "é");
    assert_eq!(d.push(ids[2]).unwrap(), "!");
    // A dangling lead byte at the end is flushed (as the replacement character) only on flush.
    let mut d = crate::Detokenizer::new(&tok);
    assert_eq!(d.push(ids[0]).unwrap(), "");
    assert_eq!(d.flush().unwrap(), "\u{FFFD}");
}

#[test]
fn llama3_rope_frequencies_follow_the_reference_formula() {
    let scaling = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let rope = crate::layers::Rope::new(64, 500000.0, false, Some(&scaling)).unwrap();
    let crate::layers::Rope::Freqs { freqs, .. } = rope else { panic!("llama3 scaling gives explicit frequencies") };
    let got = freqs.to_vec_f32().unwrap();
    for (i, g) in got.iter().enumerate() {
        let f = 500000f64.powf(2.0 * i as f64 / 64.0);
        let wavelen = 2.0 * std::f64::consts::PI * f;
        let expected = if wavelen > 8192.0 {
            f * 8.0
        } else if wavelen > 2048.0 {
            let s = (8192.0 / wavelen - 1.0) / 3.0;
            f / ((1.0 - s) / 8.0 + s)
        } else {
            f
        };
        assert!(((*g as f64) - expected).abs() / expected < 1e-5, "pair {i}: {g} vs {expected}");
    }
    let err =
        crate::layers::Rope::new(64, 1e4, false, Some(&json!({"type": "longrope", "factor": 2.0}))).err().unwrap();
    assert!(err.to_string().contains("\"longrope\" is not supported") && err.to_string().contains("yarn"), "{err}");
}

// ---- GGUF ----

/// llama.cpp's `permute` of Q/K rows (what its converter writes): the inverse of ours.
fn llama_cpp_permute(w: &Array, n_head: i32) -> Array {
    let shape: Vec<i32> = w.shape().iter().map(|&d| d as i32).collect();
    w.reshape(&[n_head, 2, shape[0] / n_head / 2, shape[1]])
        .unwrap()
        .transpose(&[0, 2, 1, 3])
        .unwrap()
        .reshape(&shape)
        .unwrap()
}

fn gguf_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, module) = rest.split_once('.').unwrap();
    let kinds = [
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate", "ffn_gate_inp"),
        ("mlp.switch_mlp.gate_proj", "ffn_gate_exps"),
        ("mlp.switch_mlp.up_proj", "ffn_up_exps"),
        ("mlp.switch_mlp.down_proj", "ffn_down_exps"),
        ("mlp.switch_mlp.gate_up_proj", "ffn_gate_up_exps"),
        ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
        ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
        ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
        ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
    ];
    let (m, suffix) = module.rsplit_once('.').unwrap();
    let g = kinds.iter().find(|(h, _)| *h == m).unwrap().1;
    format!("blk.{layer}.{g}.{suffix}")
}

/// GGUF metadata values as MLX's writer takes them, and the byte vocabulary's tokenizer keys.
fn gguf_u32(v: u32) -> mlx::io::GgufValue {
    mlx::io::GgufValue::Array(Array::from_u32(&[v], &[1]).unwrap())
}

fn gguf_f32(v: f32) -> mlx::io::GgufValue {
    mlx::io::GgufValue::Array(Array::from_f32(&[v], &[1]).unwrap())
}

/// `testing::byte_tokenizer_json()` as a GGUF's `tokenizer.*` keys (`pre`: its pre-tokenizer).
fn byte_vocab_meta(pre: &str) -> Vec<(&'static str, mlx::io::GgufValue)> {
    use mlx::io::GgufValue;
    let tok = testing::byte_tokenizer_json();
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    let types: Vec<i32> = (0..tokens.len()).map(|i| if i < 2 { 3 } else { 1 }).collect();
    vec![
        ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
        ("tokenizer.ggml.tokens", GgufValue::Strings(tokens)),
        ("tokenizer.ggml.token_type", GgufValue::Array(Array::from_i32(&types, &[types.len()]).unwrap())),
        ("tokenizer.ggml.merges", GgufValue::Strings(vec![])),
        ("tokenizer.ggml.bos_token_id", gguf_u32(0)),
        ("tokenizer.ggml.eos_token_id", gguf_u32(1)),
        ("tokenizer.chat_template", GgufValue::String(testing::CHATML.into())),
    ]
}

/// Writes the tiny Llama of `testing::write_model(dir, "llama", seed)` as a GGUF file the
/// way llama.cpp's converter would (names, permuted Q/K rows, tokenizer metadata).
fn write_tiny_gguf(path: &Path, seed: u64, dtype: Dtype) {
    use mlx::io::GgufValue;
    let weights = testing::weights_with_vocab("llama", seed, testing::BYTE_VOCAB).unwrap();
    let mut tensors: Vec<(String, Array)> = Vec::new();
    for (name, a) in &weights {
        let a = if name.ends_with("q_proj.weight") {
            llama_cpp_permute(a, 4)
        } else if name.ends_with("k_proj.weight") {
            llama_cpp_permute(a, 2)
        } else {
            a.clone()
        };
        let a = if name.contains("norm") { a } else { a.astype(dtype).unwrap() };
        tensors.push((gguf_name(name), a));
    }
    let (u32s, f32s) = (gguf_u32, gguf_f32);
    let mut meta = vec![
        ("general.architecture", GgufValue::String("llama".into())),
        ("llama.block_count", u32s(2)),
        ("llama.embedding_length", u32s(64)),
        ("llama.feed_forward_length", u32s(128)),
        ("llama.attention.head_count", u32s(4)),
        ("llama.attention.head_count_kv", u32s(2)),
        ("llama.attention.layer_norm_rms_epsilon", f32s(1e-5)),
        ("llama.rope.freq_base", f32s(10000.0)),
        ("llama.context_length", u32s(2048)),
    ];
    meta.extend(byte_vocab_meta("gpt2"));
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_gguf(path, &refs, &meta).unwrap();
}

fn last_logits(loaded: &crate::Loaded, ids: &[u32]) -> Array {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    let logits = loaded.model.forward(&tokens(&ids), &mut loaded.model.make_cache()).unwrap();
    let n = ids.len() as i32;
    logits.slice_axis(1, n - 1, n).unwrap()
}

#[test]
fn a_gguf_file_loads_as_the_same_model_as_its_folder() {
    let dir = temp_dir("gguf");
    testing::write_model(&dir.join("folder"), "llama", 21).unwrap();
    let folder = load(&dir.join("folder")).unwrap();
    let messages = json!([{"role": "user", "content": "hello there"}]);
    let ids = folder.tokenizer.encode_chat(&messages, None, true).unwrap();
    let want = last_logits(&folder, &ids);

    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, 21, Dtype::Float32);
    let gguf =
        crate::load_with(&path, &crate::LoadOptions { dequantize_gguf: Some(true), ..Default::default() }).unwrap();
    assert_eq!(gguf.info.model_type, "llama");
    assert_eq!(gguf.info.eos_token_ids, vec![1]);
    assert_eq!(gguf.tokenizer.encode_chat(&messages, None, true).unwrap(), ids, "tokenizer and template from metadata");
    let d = max_abs_diff(&want, &last_logits(&gguf, &ids));
    assert!(d < 1e-5, "F32 GGUF differs from the folder by {d}: Q/K rows not un-permuted?");

    // F16 tensors are widened to float32 on the CPU; results agree to f16 rounding.
    write_tiny_gguf(&path, 21, Dtype::Float16);
    let gguf16 =
        crate::load_with(&path, &crate::LoadOptions { dequantize_gguf: Some(true), ..Default::default() }).unwrap();
    let d = max_abs_diff(&want, &last_logits(&gguf16, &ids));
    assert!(d < 5e-2, "F16 GGUF differs by {d}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// llama.cpp's `_reorder_v_heads`: value heads from grouped by key head to tiled, along `axis`.
fn llama_cpp_tiled(a: &Array, axis: usize, k: i32, r: i32) -> Array {
    let shape: Vec<i32> = a.shape().iter().map(|&d| d as i32).collect();
    let mut split = shape[..axis].to_vec();
    split.extend([k, r, shape[axis] / (k * r)]);
    split.extend(&shape[axis + 1..]);
    let mut perm: Vec<i32> = (0..split.len() as i32).collect();
    perm.swap(axis, axis + 1);
    a.reshape(&split).unwrap().transpose(&perm).unwrap().reshape(&shape).unwrap()
}

/// Writes the tiny Qwen3.5 of `testing::write_model(dir, "qwen3_5", seed)` as llama.cpp's
/// converter writes a `qwen35` file (`conversion/qwen.py`): its tensor names, `-exp(A_log)`,
/// `dt_bias` as `ssm_dt.bias`, the conv kernel squeezed, the value heads (4, over 2 key heads)
/// reordered to tiled in every DeltaNet tensor, and a multi-token-prediction block after the
/// last layer, which a loader must drop.
fn write_tiny_qwen35_gguf(path: &Path, seed: u64) {
    use mlx::io::GgufValue;
    let weights = testing::weights_with_vocab("qwen3_5", seed, testing::BYTE_VOCAB).unwrap();
    let (k, r, kd) = (2, 2, 16);
    let qk = 2 * k * kd;
    let tiled_rows = |a: &Array, from: i32| {
        let rows = a.dim(0) as i32;
        let v = llama_cpp_tiled(&a.slice_axis(0, from, rows).unwrap(), 0, k, r);
        mlx::ops::concatenate(&[&a.slice_axis(0, 0, from).unwrap(), &v], 0).unwrap()
    };
    let mut tensors: Vec<(String, Array)> = Vec::new();
    for (name, a) in &weights {
        let g = |n: &str| n.to_string();
        let (gname, a) = match name.as_str() {
            "model.embed_tokens.weight" => (g("token_embd.weight"), a.clone()),
            "model.norm.weight" => (g("output_norm.weight"), a.clone()),
            _ => {
                let rest = name.strip_prefix("model.layers.").unwrap();
                let (l, module) = rest.split_once('.').unwrap();
                let kinds = [
                    ("input_layernorm.weight", "attn_norm.weight"),
                    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
                    ("mlp.gate_proj.weight", "ffn_gate.weight"),
                    ("mlp.up_proj.weight", "ffn_up.weight"),
                    ("mlp.down_proj.weight", "ffn_down.weight"),
                    ("self_attn.q_proj.weight", "attn_q.weight"),
                    ("self_attn.k_proj.weight", "attn_k.weight"),
                    ("self_attn.v_proj.weight", "attn_v.weight"),
                    ("self_attn.o_proj.weight", "attn_output.weight"),
                    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
                    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
                    ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight"),
                    ("linear_attn.in_proj_z.weight", "attn_gate.weight"),
                    ("linear_attn.in_proj_a.weight", "ssm_alpha.weight"),
                    ("linear_attn.in_proj_b.weight", "ssm_beta.weight"),
                    ("linear_attn.conv1d.weight", "ssm_conv1d.weight"),
                    ("linear_attn.A_log", "ssm_a"),
                    ("linear_attn.dt_bias", "ssm_dt.bias"),
                    ("linear_attn.norm.weight", "ssm_norm.weight"),
                    ("linear_attn.out_proj.weight", "ssm_out.weight"),
                ];
                let kind = kinds.iter().find(|(h, _)| *h == module).unwrap_or_else(|| panic!("{name}")).1;
                let a = match module {
                    "linear_attn.in_proj_qkv.weight" => tiled_rows(a, qk),
                    "linear_attn.in_proj_z.weight"
                    | "linear_attn.in_proj_a.weight"
                    | "linear_attn.in_proj_b.weight" => llama_cpp_tiled(a, 0, k, r),
                    "linear_attn.conv1d.weight" => {
                        tiled_rows(&a.reshape(&[a.dim(0) as i32, a.dim(1) as i32]).unwrap(), qk)
                    }
                    "linear_attn.A_log" => llama_cpp_tiled(&a.exp().unwrap().negative().unwrap(), 0, k, r),
                    "linear_attn.dt_bias" => llama_cpp_tiled(a, 0, k, r),
                    "linear_attn.out_proj.weight" => llama_cpp_tiled(a, 1, k, r),
                    _ => a.clone(),
                };
                (format!("blk.{l}.{kind}"), a)
            }
        };
        tensors.push((gname, a));
    }
    // The multi-token-prediction block (block 2 of 3).
    let mtp = Array::from_f32(&vec![0.5; 64 * 128], &[64, 128]).unwrap();
    tensors.push(("blk.2.nextn.eh_proj.weight".into(), mtp.clone()));
    tensors.push(("blk.2.attn_norm.weight".into(), Array::from_f32(&[1.0; 64], &[64]).unwrap()));
    let (u32s, f32s) = (gguf_u32, gguf_f32);
    let mut meta = vec![
        ("general.architecture", GgufValue::String("qwen35".into())),
        ("qwen35.block_count", u32s(3)),
        ("qwen35.nextn_predict_layers", u32s(1)),
        ("qwen35.embedding_length", u32s(64)),
        ("qwen35.feed_forward_length", u32s(128)),
        ("qwen35.attention.head_count", u32s(4)),
        ("qwen35.attention.head_count_kv", u32s(2)),
        ("qwen35.attention.key_length", u32s(16)),
        ("qwen35.attention.value_length", u32s(16)),
        ("qwen35.attention.layer_norm_rms_epsilon", f32s(1e-5)),
        ("qwen35.rope.freq_base", f32s(10000.0)),
        ("qwen35.rope.dimension_count", u32s(4)),
        ("qwen35.context_length", u32s(2048)),
        ("qwen35.ssm.conv_kernel", u32s(4)),
        ("qwen35.ssm.state_size", u32s(16)),
        ("qwen35.ssm.group_count", u32s(2)),
        ("qwen35.ssm.time_step_rank", u32s(4)),
        ("qwen35.ssm.inner_size", u32s(64)),
        ("qwen35.full_attention_interval", u32s(2)),
    ];
    meta.extend(byte_vocab_meta("qwen35"));
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_gguf(path, &refs, &meta).unwrap();
}

/// A `qwen35` GGUF (as llama.cpp's converter lays one out; no converter runs here, so the
/// file is written by the test from `conversion/qwen.py`'s transforms) loads as the same
/// hybrid model as its folder: the value heads regrouped, `A_log` and `dt_bias` restored, the
/// MTP block dropped.
#[test]
fn a_qwen35_gguf_file_loads_as_the_same_hybrid_model_as_its_folder() {
    let dir = temp_dir("gguf-qwen35");
    testing::write_model(&dir.join("folder"), "qwen3_5", 23).unwrap();
    let folder = load(&dir.join("folder")).unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 250 + 2).collect();
    let want = last_logits(&folder, &ids);
    let path = dir.join("tiny-qwen35.gguf");
    write_tiny_qwen35_gguf(&path, 23);
    let gguf =
        crate::load_with(&path, &crate::LoadOptions { dequantize_gguf: Some(true), ..Default::default() }).unwrap();
    assert_eq!(gguf.info.model_type, "qwen3_5");
    assert_eq!(gguf.info.n_layers, 2, "the MTP block is not a layer");
    assert_eq!(gguf.info.recurrent_layers, 1);
    let d = max_abs_diff(&want, &last_logits(&gguf, &ids));
    assert!(d < 1e-4, "the qwen35 GGUF differs from the folder by {d}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Writes the tiny `model_type` (qwen3_moe or qwen2_moe) of `testing::write_model` as
/// llama.cpp's converter writes a `qwen3moe`/`qwen2moe` file: HF names mapped, Hugging Face's
/// per-expert modules stacked into `[E, ...]` tensors (the qwen3moe's gate and up fused, as
/// `--fuse-gate-up-exps` writes them), a shared expert's gate `[1, H]` stored `[H]`; no Q/K
/// permutation (Qwen's rotary layout is llama.cpp's NeoX one).
fn write_tiny_moe_gguf(path: &Path, model_type: &str, seed: u64) {
    use mlx::io::GgufValue;
    let arch = if model_type == "qwen3_moe" { "qwen3moe" } else { "qwen2moe" };
    let weights = testing::weights_with_vocab(model_type, seed, testing::BYTE_VOCAB).unwrap();
    let mut tensors: Vec<(String, Array)> = Vec::new();
    let mut experts: std::collections::BTreeMap<(String, String), Vec<(usize, Array)>> = Default::default();
    for (name, a) in &weights {
        if let Some((stem, rest)) = name.split_once(".mlp.experts.") {
            let (e, module) = rest.split_once('.').unwrap();
            let module = module.trim_end_matches(".weight").to_string();
            experts.entry((stem.to_string(), module)).or_default().push((e.parse().unwrap(), a.clone()));
            continue;
        }
        let a = if name.ends_with("shared_expert_gate.weight") { a.reshape(&[-1]).unwrap() } else { a.clone() };
        tensors.push((gguf_name(name), a));
    }
    let mut stacked: std::collections::HashMap<(String, String), Array> = Default::default();
    for ((stem, module), mut list) in experts {
        list.sort_by_key(|(e, _)| *e);
        let parts: Vec<Array> = list.iter().map(|(_, a)| a.expand_dims(&[0]).unwrap()).collect();
        let refs: Vec<&Array> = parts.iter().collect();
        stacked.insert((stem, module), mlx::ops::concatenate(&refs, 0).unwrap());
    }
    let layers: std::collections::BTreeSet<String> = stacked.keys().map(|(s, _)| s.clone()).collect();
    for stem in layers {
        let get = |m: &str| stacked[&(stem.clone(), m.to_string())].clone();
        let name = |m: &str| gguf_name(&format!("{stem}.mlp.switch_mlp.{m}.weight"));
        let gate_up = mlx::ops::concatenate(&[&get("gate_proj"), &get("up_proj")], 1).unwrap();
        tensors.push((name("gate_up_proj"), gate_up));
        tensors.push((name("down_proj"), get("down_proj")));
    }
    let (u32s, f32s) = (gguf_u32, gguf_f32);
    let key = |k: &str| -> &'static str { Box::leak(format!("{arch}.{k}").into_boxed_str()) };
    let mut meta = vec![
        ("general.architecture", GgufValue::String(arch.into())),
        (key("block_count"), u32s(2)),
        (key("embedding_length"), u32s(64)),
        (key("feed_forward_length"), u32s(128)),
        (key("attention.head_count"), u32s(4)),
        (key("attention.head_count_kv"), u32s(2)),
        (key("attention.key_length"), u32s(16)),
        (key("attention.value_length"), u32s(16)),
        (key("attention.layer_norm_rms_epsilon"), f32s(1e-5)),
        (key("rope.freq_base"), f32s(10000.0)),
        (key("context_length"), u32s(2048)),
        (key("expert_count"), u32s(4)),
        (key("expert_used_count"), u32s(2)),
        (key("expert_feed_forward_length"), u32s(32)),
    ];
    if arch == "qwen2moe" {
        meta.push((key("expert_shared_feed_forward_length"), u32s(128)));
    }
    meta.extend(byte_vocab_meta("qwen2"));
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_gguf(path, &refs, &meta).unwrap();
}

/// `qwen3moe` and `qwen2moe` GGUF files (Qwen3-30B-A3B's and Qwen1.5/2-MoE's kind) load as the
/// same mixtures as their folders: the router and stacked experts, the qwen3moe's fused gate
/// and up split, its dense layer found by its missing router, the qwen2moe's shared expert.
#[test]
fn qwen_moe_gguf_files_load_as_the_same_mixtures_as_their_folders() {
    for (model_type, seed) in [("qwen3_moe", 25), ("qwen2_moe", 26)] {
        let dir = temp_dir(&format!("gguf-{model_type}"));
        testing::write_model(&dir.join("folder"), model_type, seed).unwrap();
        let folder = load(&dir.join("folder")).unwrap();
        let ids: Vec<u32> = (0..24).map(|i| (i * 11 + 5) % 250 + 2).collect();
        let want = last_logits(&folder, &ids);
        let path = dir.join("tiny.gguf");
        write_tiny_moe_gguf(&path, model_type, seed);
        let gguf =
            crate::load_with(&path, &crate::LoadOptions { dequantize_gguf: Some(true), ..Default::default() }).unwrap();
        assert_eq!(gguf.info.model_type, model_type);
        let d = max_abs_diff(&want, &last_logits(&gguf, &ids));
        assert!(d < 1e-4, "the {model_type} GGUF differs from the folder by {d}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_damaged_gguf_file_is_a_clear_error() {
    let dir = temp_dir("gguf-bad");
    let path = dir.join("bad.gguf");
    write_tiny_gguf(&path, 22, Dtype::Float32);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let err = crate::load(&path).err().expect("a truncated GGUF must not load").to_string();
    assert!(err.contains("bad.gguf"), "{err}");
    std::fs::write(&path, b"not a gguf file at all").unwrap();
    let err = crate::load(&path).err().expect("garbage must not load").to_string();
    assert!(err.contains("bad.gguf") && err.contains("GGUF"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// The tiny `arch` model's weights in `dtype`, with every linear layer of the decoder MLX-quantized
/// (group 32) to `bits` where given, except the modules in `dense`.
fn tiny_weights(arch: &str, dtype: Dtype, bits: Option<i32>, dense: &[&str]) -> crate::weights::Weights {
    let mut w: std::collections::HashMap<String, Array> =
        testing::weights(arch, 4).unwrap().into_iter().map(|(k, v)| (k, v.astype(dtype).unwrap())).collect();
    let mut overrides = std::collections::HashMap::new();
    if let Some(bits) = bits {
        let names: Vec<String> = w.keys().filter(|n| n.contains("_proj.weight")).cloned().collect();
        for name in names {
            let prefix = name.trim_end_matches(".weight").to_string();
            if dense.iter().any(|d| prefix.ends_with(d)) {
                overrides.insert(prefix, None);
                continue;
            }
            let (q, scales, biases) = mlx::ops::quantize(&w[&name], 32, bits).unwrap();
            w.insert(name, q);
            w.insert(format!("{prefix}.scales"), scales);
            w.insert(format!("{prefix}.biases"), biases);
        }
    }
    let q = bits.map(|bits| crate::weights::Quantization::affine(32, bits));
    crate::weights::Weights::new(w, Path::new("<tiny>"), arch).with_quantization(q, overrides)
}

fn with_fusion(fuse: bool) -> crate::LoadOptions {
    crate::LoadOptions { fuse_projections: Some(fuse), ..Default::default() }
}

/// The largest difference between `a` and `b` relative to the largest magnitude in `a`.
fn max_rel_diff(a: &Array, b: &Array) -> f32 {
    let (a32, b32) = (a.astype(Dtype::Float32).unwrap(), b.astype(Dtype::Float32).unwrap());
    let scale = a32.to_vec_f32().unwrap().iter().fold(0.0f32, |m, x| m.max(x.abs()));
    max_abs_diff(&a32, &b32) / scale.max(f32::MIN_POSITIVE)
}

#[test]
fn fused_projections_give_the_separate_projections_logits() {
    // Bounds per weight dtype, relative to the largest logit: one matmul over the
    // concatenated rows computes each output from the same products as three, so only the
    // accumulation order of a differently shaped kernel may differ (on the CPU nothing does:
    // every case is bit-identical; the bounds are for GPU kernels). Fused, the models without
    // q/k norms (llama, qwen2) also rotate q and k heads in one RoPE, elementwise per head.
    for (dtype, bound) in [(Dtype::Float32, 1e-5), (Dtype::Bfloat16, 2e-2), (Dtype::Float16, 2e-3)] {
        for arch in ARCHS {
            for bits in [None, Some(8), Some(4)] {
                let separate =
                    testing::model_from(arch, &mut tiny_weights(arch, dtype, bits, &[]), &with_fusion(false)).unwrap();
                let mut w = tiny_weights(arch, dtype, bits, &[]);
                let fused = testing::model_from(arch, &mut w, &with_fusion(true)).unwrap();
                for layer in 0..2 {
                    let p = format!("model.layers.{layer}");
                    assert!(w.contains(&format!("{p}.self_attn.fused_qkv.weight")), "{arch} {bits:?}");
                    if (arch == "qwen3_moe" && layer == 0) || arch == "gpt_oss" || arch == "qwen2_moe" {
                        // Experts are stacked, not fused.
                        let experts = if arch == "gpt_oss" { "experts" } else { "switch_mlp" };
                        assert!(w.contains(&format!("{p}.mlp.{experts}.up_proj.weight")), "{arch} {bits:?}");
                        continue;
                    }
                    assert!(
                        w.contains(&format!("{p}.mlp.fused_gate_up.weight"))
                            && !w.contains(&format!("{p}.mlp.up_proj.weight"))
                    );
                }
                let ids = prompt(20);
                // A prefill then single steps: both matmul shapes.
                let (a, _) = decode_in_pieces(separate.as_ref(), &ids, &[16, 1, 1, 1, 1]);
                let (b, _) = decode_in_pieces(fused.as_ref(), &ids, &[16, 1, 1, 1, 1]);
                let d = max_rel_diff(&a, &b);
                eprintln!("{dtype:?} {arch} {bits:?}: max relative diff {d}");
                assert!(d <= bound, "{dtype:?} {arch} {bits:?}: max relative diff {d} > {bound}");
            }
        }
    }
}

#[test]
fn projections_in_different_formats_stay_separate() {
    // k_proj dense among quantized q and v: nothing is fused for attention, and the model
    // still computes what the unfused one does.
    let mut w = tiny_weights("llama", Dtype::Float32, Some(8), &["k_proj"]);
    let parts: Vec<String> =
        ["q_proj", "k_proj", "v_proj"].iter().map(|m| format!("model.layers.0.self_attn.{m}")).collect();
    let rows = |w: &crate::weights::Weights, parts: &[String]| -> Vec<usize> {
        parts.iter().map(|p| w.get(&format!("{p}.weight")).unwrap().dim(0)).collect()
    };
    assert!(!w.fuse_rows(&parts, &rows(&w, &parts), "model.layers.0.self_attn.fused_qkv").unwrap());
    assert!(
        w.contains("model.layers.0.self_attn.q_proj.scales") && w.contains("model.layers.0.self_attn.k_proj.weight")
    );
    let gate_up: Vec<String> = ["gate_proj", "up_proj"].iter().map(|m| format!("model.layers.0.mlp.{m}")).collect();
    let mut wrong = rows(&w, &gate_up);
    wrong[1] += 1;
    assert!(
        !w.fuse_rows(&gate_up, &wrong, "model.layers.0.mlp.fused_gate_up").unwrap(),
        "a misfit part stays separate"
    );
    assert!(w.fuse_rows(&gate_up, &rows(&w, &gate_up), "model.layers.0.mlp.fused_gate_up").unwrap());
    assert!(!w.contains("model.layers.0.mlp.gate_proj.weight"), "fused parts are dropped");
    assert_eq!(w.get("model.layers.0.mlp.fused_gate_up.scales").unwrap().shape(), vec![256, 2]);

    let separate = testing::model_from(
        "llama",
        &mut tiny_weights("llama", Dtype::Float32, Some(8), &["k_proj"]),
        &with_fusion(false),
    )
    .unwrap();
    let fused = testing::model_from(
        "llama",
        &mut tiny_weights("llama", Dtype::Float32, Some(8), &["k_proj"]),
        &with_fusion(true),
    )
    .unwrap();
    let ids = prompt(8);
    let (a, _) = decode_in_pieces(separate.as_ref(), &ids, &[8]);
    let (b, _) = decode_in_pieces(fused.as_ref(), &ids, &[8]);
    assert!(max_abs_diff(&a, &b) <= 1e-5);
}

/// Short causal queries (speculative verification) attend through the unfused graph with an
/// explicit causal mask; on the CPU, where the fused op runs MLX's own fallback, both must
/// agree bit for bit with the fused causal op, with and without grouped heads, in float32 and
/// bfloat16, from 2 to `SHORT_QUERY` queries; and so do single queries (decode steps), which
/// take the unfused graph on the CPU too.
#[test]
fn short_causal_queries_attend_exactly_as_the_fused_op() {
    use crate::layers::{attention, attention_unfused, causal_mask, SHORT_QUERY};
    use mlx::fast::{self, Mask};
    let values = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 500.0) - 1.0).collect()
    };
    for (heads, kv_heads) in [(4, 4), (8, 2)] {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            for (l, s) in [(2, 2), (5, 9), (SHORT_QUERY, SHORT_QUERY + 7)] {
                let d = 16;
                let make = |h: usize, n: usize, seed| {
                    Array::from_f32(&values(h * n * d, seed), &[1, h, n, d]).unwrap().astype(dtype).unwrap()
                };
                let (q, k, v) = (make(heads, l, 1), make(kv_heads, s, 2), make(kv_heads, s, 3));
                let fused = fast::scaled_dot_product_attention(&q, &k, &v, 0.25, Mask::Causal).unwrap();
                let mask = causal_mask(l, s - l).unwrap();
                let unfused = attention_unfused(&q, &k, &v, 0.25, Some(&mask), None).unwrap();
                let routed = attention(&q, &k, &v, 0.25, Mask::Array(&mask), None).unwrap();
                assert_eq!(unfused.shape(), fused.shape());
                assert_eq!(
                    unfused.to_vec_f32().unwrap(),
                    fused.to_vec_f32().unwrap(),
                    "{heads}/{kv_heads} {dtype:?} {l}x{s}"
                );
                assert_eq!(routed.to_vec_f32().unwrap(), fused.to_vec_f32().unwrap());
            }
            // One query a row (a batch's decode step; on the CPU the unfused graph, with the
            // host's softmax), unmasked and with a row padded on the left.
            let (b, s, d) = (2usize, 11usize, 16usize);
            let make = |h: usize, n: usize, seed| {
                Array::from_f32(&values(b * h * n * d, seed), &[b, h, n, d]).unwrap().astype(dtype).unwrap()
            };
            let (q, k, v) = (make(heads, 1, 4), make(kv_heads, s, 5), make(kv_heads, s, 6));
            let keep: Vec<i32> = (0..b * s).map(|i| i32::from(i >= s + 3 || i < s)).collect();
            let mask = Array::from_i32(&keep, &[b, 1, 1, s]).unwrap().astype(Dtype::Bool).unwrap();
            for masked in [false, true] {
                let label = format!("{heads}/{kv_heads} {dtype:?} one query, masked: {masked}");
                let m = || if masked { Mask::Array(&mask) } else { Mask::None };
                let routed = attention(&q, &k, &v, 0.25, m(), None).unwrap().to_vec_f32().unwrap();
                let fused = fast::scaled_dot_product_attention(&q, &k, &v, 0.25, m()).unwrap().to_vec_f32().unwrap();
                assert_eq!(routed, fused, "{label}");
            }
        }
        // An 8-row step over 300 keys of caches with room past them (keys and values a slice
        // of a longer buffer): float32 products this size take the host's batched matmul on
        // the CPU (its matrices spread over threads), whose bits must be MLX's.
        let (b, s, d) = (8usize, 300usize, 64usize);
        let make = |h: usize, n: usize, seed| Array::from_f32(&values(b * h * n * d, seed), &[b, h, n, d]).unwrap();
        let room = |a: Array| a.slice_axis(2, 0, s as i32).unwrap();
        let (q, k, v) = (make(heads, 1, 7), room(make(kv_heads, s + 20, 8)), room(make(kv_heads, s + 20, 9)));
        let keep: Vec<i32> = (0..b * s).map(|i| i32::from(i % s >= (i / s) * 7)).collect();
        let mask = Array::from_i32(&keep, &[b, 1, 1, s]).unwrap().astype(Dtype::Bool).unwrap();
        let routed = attention(&q, &k, &v, 0.25, Mask::Array(&mask), None).unwrap().to_vec_f32().unwrap();
        let fused =
            fast::scaled_dot_product_attention(&q, &k, &v, 0.25, Mask::Array(&mask)).unwrap().to_vec_f32().unwrap();
        assert_eq!(routed, fused, "{heads}/{kv_heads} float32, 8 rows over {s} keys");
    }
}

/// A sequence decoded alone, greedily: the logits of each step after its prompt, and the
/// tokens fed (the prompt's last token, then each greedy pick).
fn solo_greedy(model: &dyn CausalLm, ids: &[i32], steps: usize) -> (Vec<Array>, Vec<i32>) {
    let mut cache = model.make_cache();
    if ids.len() > 1 {
        model.forward(&tokens(&ids[..ids.len() - 1]), &mut cache).unwrap();
    }
    let mut fed = vec![*ids.last().unwrap()];
    let mut logits = Vec::new();
    for _ in 0..steps {
        let l = model.forward(&tokens(&fed[fed.len() - 1..]), &mut cache).unwrap().reshape(&[-1]).unwrap();
        fed.push(l.argmax(-1, false).unwrap().item_i32().unwrap());
        logits.push(l);
    }
    (logits, fed)
}

/// `model`'s caches, sliding layers' keeping `slack` positions beyond their window.
fn caches_with_slack(model: &dyn CausalLm, slack: usize) -> Vec<KvCache> {
    model.make_cache().into_iter().map(|c| c.with_slack(slack)).collect()
}

/// A row holding `p` but its last token (prefilled alone, sliding layers keeping `slack`).
fn prefilled(model: &dyn CausalLm, p: &[i32], slack: usize) -> Vec<KvCache> {
    let mut cache = caches_with_slack(model, slack);
    if p.len() > 1 {
        model.forward(&tokens(&p[..p.len() - 1]), &mut cache).unwrap();
    }
    cache
}

/// A row holding `p` but its last token (prefilled alone, sliding layers keeping `slack`)
/// pushed into `batch`.
fn push_prefilled(model: &dyn CausalLm, batch: &mut [crate::BatchKvCache], p: &[i32], slack: usize) {
    let cache = prefilled(model, p, slack);
    for (b, c) in batch.iter_mut().zip(&cache) {
        b.push(c).unwrap();
    }
}

/// Rows of different lengths decoded together in a `BatchKvCache` give each row the logits
/// it gets alone, while rows join (two at a time, in one copy: `push_all`; one crossing the
/// cache's 256-position growth step, one holding no position yet) and leave, and a row
/// extracted from the batch goes on alone where it left off. Joins and leaves leave room in
/// the buffer for the next step (which then writes in place).
#[test]
fn batched_decoding_gives_every_row_its_solo_logits_as_rows_join_and_leave() {
    check_batched_decoding(&ARCHS, crate::cache::SLACK);
}

/// The same with sliding layers keeping 2 positions beyond their window of 8: the long row
/// joins having dropped its oldest positions, the batch drops columns as it decodes, and
/// the extracted row goes on from a bounded cache.
#[test]
fn batched_decoding_with_bounded_sliding_caches_gives_every_row_its_solo_logits() {
    check_batched_decoding(&SLIDING, 2);
}

/// The tiny architectures with sliding-window layers (layer 0 slides, window 8).
const SLIDING: [&str; 3] = ["gemma3_text", "gpt_oss", "ministral3"];

fn check_batched_decoding(archs: &[&str], slack: usize) {
    for &arch in archs {
        let model = testing::model(arch, 3).unwrap();
        let model = model.as_ref();
        assert!(model.batches());
        let prompts = [prompt(3), prompt(17).into_iter().rev().collect(), prompt(250), vec![7]];
        let steps = 14;
        let solo: Vec<_> = prompts.iter().map(|p| solo_greedy(model, p, steps)).collect();
        let layers = model.make_cache().len();
        let mut batch: Vec<crate::BatchKvCache> = (0..layers).map(|_| Default::default()).collect();
        // (prompt index, steps done) per batch row, in row order.
        let mut rows: Vec<(usize, usize)> = Vec::new();
        let has_room = |batch: &[crate::BatchKvCache]| {
            assert!(batch.iter().all(|b| b.room() >= 1), "{arch}: a join or leave left no room for the next step");
        };
        let join = |batch: &mut Vec<crate::BatchKvCache>, rows: &mut Vec<(usize, usize)>, join: &[usize]| {
            let caches: Vec<Vec<KvCache>> = join.iter().map(|&i| prefilled(model, &prompts[i], slack)).collect();
            for (layer, b) in batch.iter_mut().enumerate() {
                b.push_all(&caches.iter().map(|c| &c[layer]).collect::<Vec<_>>(), 1).unwrap();
            }
            rows.extend(join.iter().map(|&i| (i, 0)));
            has_room(batch);
        };
        join(&mut batch, &mut rows, &[0, 1]);
        for step in 0..12 {
            if step == 3 {
                join(&mut batch, &mut rows, &[2, 3]);
            }
            if step == 8 {
                // Row 1 (prompt 1) leaves; the padding no row needs goes with it.
                let before = batch[0].width();
                for b in batch.iter_mut() {
                    b.remove(1).unwrap();
                }
                rows.remove(1);
                assert!(batch[0].width() <= before);
                has_room(&batch);
            }
            let input: Vec<i32> = rows.iter().map(|&(i, done)| solo[i].1[done]).collect();
            let logits = model.forward_batch(&Array::from_i32(&input, &[input.len(), 1]).unwrap(), &mut batch).unwrap();
            assert_eq!(logits.shape(), vec![rows.len(), 1, testing::VOCAB]);
            for (r, (i, done)) in rows.iter_mut().enumerate() {
                let row = logits.slice_axis(0, r as i32, r as i32 + 1).unwrap().reshape(&[-1]).unwrap();
                let d = max_abs_diff(&row, &solo[*i].0[*done]);
                assert!(d < 1e-4, "{arch}: prompt {i}, step {done}: max diff {d}");
                *done += 1;
                assert_eq!(batch[0].len(r), prompts[*i].len() + *done - 1);
            }
        }
        // The first row (prompt 0) goes on alone from its extracted cache.
        let (i, done) = rows[0];
        let mut alone: Vec<KvCache> = batch.iter().map(|b| b.extract(0).unwrap()).collect();
        assert_eq!(alone[0].offset(), prompts[i].len() + done - 1);
        for step in done..steps {
            let l = model.forward(&tokens(&solo[i].1[step..step + 1]), &mut alone).unwrap().reshape(&[-1]).unwrap();
            let d = max_abs_diff(&l, &solo[i].0[step]);
            assert!(d < 1e-4, "{arch}: extracted row, step {step}: max diff {d}");
        }
        if slack < 8 {
            assert!(batch[0].start() > 0 && alone[0].start() > 0, "{arch}: the sliding layer dropped nothing");
            assert_eq!(batch[1].start(), 0, "{arch}: the full-attention layer dropped positions");
        }
        assert!(batch[0].remove(9).is_err());
    }
}

/// Speculative rows in a batch: each step feeds every row several positions (its true next
/// tokens up to a point, then wrong "drafts"), each row keeps its own number of them
/// (`BatchKvCache::trim_rows`), and every kept position's logits are the row's solo ones —
/// through holes, their compaction, rows joining and leaving, and a row extracted and
/// decoded alone. Sliding layers (window 8) mask their window by each row's positions, a row
/// of 600 making their caches drop their oldest columns; recurrent layers (Qwen3.5's DeltaNet)
/// take each row's state from before its first rejected position.
#[test]
fn ragged_rollback_in_a_batch_gives_every_row_its_solo_logits() {
    for arch in ["llama", "qwen3", "qwen3_moe", "phi3", "gemma3_text", "gpt_oss", "ministral3", "qwen3_5"] {
        let model = testing::model(arch, 3).unwrap();
        let model = model.as_ref();
        let sliding = model.make_cache().iter().any(KvCache::is_windowed);
        // A sliding model's long row takes more steps to gather holes enough to compact.
        let (long, loops, steps) = if sliding { (600, 90, 300) } else { (40, 40, 200) };
        let prompts = [prompt(3), prompt(17).into_iter().rev().collect(), prompt(long), vec![7]];
        let solo: Vec<_> = prompts.iter().map(|p| solo_greedy(model, p, steps)).collect();
        let layers = model.make_cache().len();
        let mut batch: Vec<crate::BatchKvCache> = (0..layers).map(|_| Default::default()).collect();
        let mut rows: Vec<(usize, usize)> = Vec::new();
        let join = |batch: &mut Vec<crate::BatchKvCache>, rows: &mut Vec<(usize, usize)>, i: usize| {
            push_prefilled(model, batch, &prompts[i], crate::cache::SLACK);
            rows.push((i, 0));
        };
        join(&mut batch, &mut rows, 0);
        join(&mut batch, &mut rows, 1);
        let (mut saw_holes, mut compacted) = (false, false);
        for step in 0..loops {
            if step == 3 {
                join(&mut batch, &mut rows, 2);
            }
            if step == 5 {
                join(&mut batch, &mut rows, 3);
            }
            if step == 14 {
                for b in batch.iter_mut() {
                    b.remove(1).unwrap();
                }
                rows.remove(1);
            }
            let t = 1 + step % 5;
            let kept: Vec<usize> = (0..rows.len()).map(|r| 1 + (step + 2 * r) % t).collect();
            let mut input = Vec::new();
            for (r, &(i, done)) in rows.iter().enumerate() {
                for j in 0..t {
                    let right = solo[i].1[done + j];
                    input.push(if j < kept[r] { right } else { (right * 7 + 3) % testing::VOCAB as i32 });
                }
            }
            batch.iter_mut().for_each(|b| b.keep_snapshots(t));
            let logits = model.forward_batch(&Array::from_i32(&input, &[rows.len(), t]).unwrap(), &mut batch).unwrap();
            assert_eq!(logits.shape(), vec![rows.len(), t, testing::VOCAB]);
            for (r, (i, done)) in rows.iter_mut().enumerate() {
                for j in 0..kept[r] {
                    let got =
                        logits.slice_axis(0, r as i32, r as i32 + 1).unwrap().slice_axis(1, j as i32, j as i32 + 1);
                    let d = max_abs_diff(&got.unwrap().reshape(&[-1]).unwrap(), &solo[*i].0[*done + j]);
                    assert!(d < 1e-4, "{arch}: prompt {i}, position {}: max diff {d}", *done + j);
                }
            }
            for b in batch.iter_mut() {
                b.trim_rows(t, &kept).unwrap();
            }
            // A ragged trim leaves holes unless it compacted them all.
            let ragged = kept.iter().any(|&k| k != kept[0]);
            saw_holes |= batch[0].has_holes();
            compacted |= ragged && !batch[0].has_holes();
            for (r, (i, done)) in rows.iter_mut().enumerate() {
                *done += kept[r];
                assert_eq!(batch[0].len(r), prompts[*i].len() + *done - 1, "{arch}: row {r}");
            }
        }
        assert!(saw_holes, "{arch}: no row was left with holes");
        assert!(compacted, "{arch}: the holes were never compacted");
        let (i, done) = rows[0];
        let mut alone: Vec<KvCache> = batch.iter().map(|b| b.extract(0).unwrap()).collect();
        assert_eq!(alone[0].offset(), prompts[i].len() + done - 1);
        for step in done..done + 4 {
            let l = model.forward(&tokens(&solo[i].1[step..step + 1]), &mut alone).unwrap().reshape(&[-1]).unwrap();
            let d = max_abs_diff(&l, &solo[i].0[step]);
            assert!(d < 1e-4, "{arch}: extracted row, step {step}: max diff {d}");
        }
    }
}

/// A sliding layer's bounded cache (window 8, slack 3) holds a bounded number of positions
/// however long the sequence, and gives the logits a cache of every position gives: decoding
/// token by token, after rollbacks of up to its slack (and one it refuses to take past its
/// window), and through a fork scored as a batch and a row adopted from it.
#[test]
fn a_bounded_sliding_cache_decodes_as_a_full_one_and_still_rolls_back() {
    let (window, slack) = (testing::GEMMA_WINDOW, 3);
    for arch in SLIDING {
        let model = testing::model(arch, 6).unwrap();
        let model = model.as_ref();
        let full = || -> Vec<KvCache> { (0..model.make_cache().len()).map(|_| KvCache::default()).collect() };
        let (mut bounded, mut reference) = (caches_with_slack(model, slack), full());
        let ids = prompt(300);
        let step = |cache: &mut Vec<KvCache>, ids: &[i32]| model.forward(&tokens(ids), cache).unwrap();
        let d = max_abs_diff(&step(&mut bounded, &ids[..40]), &step(&mut reference, &ids[..40]));
        assert!(d < 1e-5, "{arch}: prefill, max diff {d}");
        for i in 40..300 {
            if i % 50 == 0 {
                // Three wrong tokens, rolled back.
                step(&mut bounded, &[1, 2, 3]);
                for c in &mut bounded {
                    assert!(c.trimmable() >= slack, "{arch}: only {} trimmable", c.trimmable());
                    assert_eq!(c.trim(3), 3);
                }
            }
            let d = max_abs_diff(&step(&mut bounded, &ids[i..i + 1]), &step(&mut reference, &ids[i..i + 1]));
            assert!(d < 1e-5, "{arch}: position {i}, max diff {d}");
        }
        let (sliding, global) = (&bounded[0], &bounded[1]);
        assert_eq!((sliding.window(), global.window()), (Some(window), None));
        assert!(sliding.start() > 0 && global.start() == 0);
        assert!(
            sliding.offset() - sliding.start() <= window - 1 + slack + 256,
            "{arch}: holds {}..{}",
            sliding.start(),
            sliding.offset()
        );
        assert!(sliding.nbytes() < reference[0].nbytes(), "{arch}: no memory saved");
        // A rollback past what a full window needs is cut short.
        let mut over = sliding.clone();
        let most = over.trimmable();
        assert_eq!(over.trim(most + 5), most);
        assert_eq!(over.offset() - over.start(), window - 1);
        // A fork of the bounded caches scores two continuations; row 1 is adopted.
        let rows: [i32; 8] = [9, 8, 7, 6, 5, 4, 3, 2];
        let mut forks: Vec<KvCache> = bounded.iter().map(|c| c.fork_batch(2).unwrap()).collect();
        let scored = model.forward(&Array::from_i32(&rows, &[2, 4]).unwrap(), &mut forks).unwrap();
        let direct = step(&mut reference, &rows[4..]);
        let d = max_abs_diff(&scored.slice_axis(0, 1, 2).unwrap(), &direct);
        assert!(d < 1e-5, "{arch}: forked row, max diff {d}");
        for (c, f) in bounded.iter_mut().zip(&forks) {
            c.adopt_row(f, 1, 4).unwrap();
        }
        let d = max_abs_diff(&step(&mut bounded, &[11]), &step(&mut reference, &[11]));
        assert!(d < 1e-5, "{arch}: after adopting the fork's row, max diff {d}");
    }
}

/// Qwen3.5's hybrid: a DeltaNet layer's recurrent state carries a sequence as its keys and
/// values would: token by token and in uneven chunks (each chunk runs the recurrence from
/// the state the last one left) give one full forward's logits.
#[test]
fn a_recurrent_layer_decodes_token_by_token_and_in_chunks_as_one_forward() {
    let model = testing::model("qwen3_5", 4).unwrap();
    let cache = model.make_cache();
    assert!(cache[0].is_recurrent() && !cache[1].is_recurrent());
    let ids = prompt(40);
    let (full, _) = decode_in_pieces(model.as_ref(), &ids, &[40]);
    for pieces in [&[1; 40][..], &[7, 1, 19, 13]] {
        let (split, cache) = decode_in_pieces(model.as_ref(), &ids, pieces);
        assert_eq!((cache[0].offset(), cache[1].offset()), (40, 40));
        let d = max_abs_diff(&full, &split);
        assert!(d < 1e-4, "{pieces:?}: max diff {d}");
    }
}

/// A recurrent cache keeps the states at its last offsets, as many as asked
/// (`keep_snapshots`): a verified window of several positions, or decode steps one by one,
/// are taken back exactly by a trim within them, and a rollback past them is refused.
#[test]
fn a_recurrent_cache_rolls_back_exactly_within_its_snapshots() {
    let model = testing::model("qwen3_5", 5).unwrap();
    let ids = prompt(16);
    let (full, _) = decode_in_pieces(model.as_ref(), &ids, &[16]);
    let (_, mut cache) = decode_in_pieces(model.as_ref(), &ids[..8], &[8]);
    for c in cache.iter_mut() {
        c.keep_snapshots(4);
    }
    assert_eq!(cache[0].trimmable(), 0, "a prefill longer than the snapshots kept leaves none");
    // A window of 4 wrong tokens, 3 of them rolled back; then the right ones one by one,
    // each decode step taken back once and redone.
    model.forward(&tokens(&[3, 1, 4, 1]), &mut cache).unwrap();
    assert_eq!(cache[0].trimmable(), 4);
    crate::roll_back(&mut cache, 3).unwrap();
    assert_eq!((cache[0].offset(), cache[0].trimmable()), (9, 1));
    crate::roll_back(&mut cache, 1).unwrap();
    assert!(cache.iter().all(|c| c.offset() == 8 && !c.stale()));
    for i in 8..16 {
        model.forward(&tokens(&[7]), &mut cache).unwrap();
        crate::roll_back(&mut cache, 1).unwrap();
        let l = model.forward(&tokens(&ids[i..i + 1]), &mut cache).unwrap();
        let d = max_abs_diff(&l, &full.slice_axis(1, i as i32, i as i32 + 1).unwrap());
        assert!(d < 1e-4, "position {i}: max diff {d}");
    }
    assert_eq!(cache[0].trimmable(), 4);
    let err = crate::roll_back(&mut cache, 5).unwrap_err().to_string();
    assert!(err.contains("recurrent") && !cache[0].stale(), "{err}");
}

/// Qwen3.5's hybrid in a batch: rows join and leave with their recurrent states beside their
/// keys and values, each gets its solo logits, and a row leaving while a step is in flight
/// takes back its state from before that step (it goes on alone from there exactly).
#[test]
fn a_hybrid_batch_gives_every_row_its_solo_logits_and_gives_back_a_step_in_flight() {
    check_batched_decoding(&["qwen3_5"], crate::cache::SLACK);
    let model = testing::model("qwen3_5", 3).unwrap();
    let model = model.as_ref();
    let prompts = [prompt(5), prompt(11)];
    let solo: Vec<_> = prompts.iter().map(|p| solo_greedy(model, p, 3)).collect();
    let mut batch: Vec<crate::BatchKvCache> = (0..model.make_cache().len()).map(|_| Default::default()).collect();
    for p in &prompts {
        let mut cache = model.make_cache();
        model.forward(&tokens(&p[..p.len() - 1]), &mut cache).unwrap();
        for (b, c) in batch.iter_mut().zip(&cache) {
            b.push(c).unwrap();
        }
    }
    assert!(batch[0].is_recurrent() && !batch[1].is_recurrent());
    let step = |batch: &mut Vec<crate::BatchKvCache>, step: usize| {
        let input = [solo[0].1[step], solo[1].1[step]];
        model.forward_batch(&Array::from_i32(&input, &[2, 1]).unwrap(), batch).unwrap();
    };
    step(&mut batch, 0);
    step(&mut batch, 1);
    let mut back: Vec<KvCache> = batch.iter().map(|b| b.extract_before_step(1).unwrap()).collect();
    assert!(back.iter().all(|c| c.offset() == prompts[1].len()));
    let l = model.forward(&tokens(&solo[1].1[1..2]), &mut back).unwrap();
    let d = max_abs_diff(&l.reshape(&[-1]).unwrap(), &solo[1].0[1]);
    assert!(d < 1e-4, "the row given back its step in flight: max diff {d}");
}

/// A Qwen3.5 model's info says what one sequence's recurrent states weigh (what a request
/// reserves beside its keys and values): for the tiny model's one DeltaNet layer, its
/// convolution inputs (3 positions of 2 x 32 + 64 channels) and state (4 x 16 x 16 float32),
/// twice; a model without recurrent layers, nothing.
#[test]
fn a_hybrid_models_info_counts_its_recurrent_state_per_sequence() {
    let dir = std::env::temp_dir().join(format!("models-state-bytes-{}", std::process::id()));
    testing::write_model(&dir, "qwen3_5", 1).unwrap();
    let loaded = crate::load(&dir).unwrap();
    assert_eq!(loaded.info.recurrent_layers, 1);
    assert_eq!(loaded.info.recurrent_state_bytes, 2 * (3 * 128 * 4 + 4 * 16 * 16 * 4));
    testing::write_model(&dir, "llama", 1).unwrap();
    assert_eq!(crate::load(&dir).unwrap().info.recurrent_state_bytes, 0);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A recurrent state cannot be cut back: it is never trimmable, and a trim that needs it
/// leaves the cache stale, so continuing from it is an error rather than wrong logits; a
/// clone taken before goes on as the uncut run.
#[test]
fn a_trimmed_recurrent_cache_goes_stale_and_is_not_continued() {
    let model = testing::model("qwen3_5", 5).unwrap();
    let ids = prompt(12);
    let (_, mut cache) = decode_in_pieces(model.as_ref(), &ids[..10], &[10]);
    assert_eq!((cache[0].trimmable(), cache[1].trimmable()), (0, 10));
    let mut kept = cache.clone();
    assert!(crate::roll_back(&mut cache, 2).is_err(), "a rollback past a recurrent layer is refused");
    assert!(!cache[0].stale());
    for c in cache.iter_mut() {
        c.trim(2);
    }
    assert!(cache[0].stale() && cache.iter().all(|c| c.offset() == 8));
    let Err(err) = model.forward(&tokens(&ids[8..10]), &mut cache) else { panic!("a stale state is refused") };
    assert!(err.to_string().contains("recomputed"), "{err}");
    let next = model.forward(&tokens(&ids[10..]), &mut kept).unwrap();
    let (full, _) = decode_in_pieces(model.as_ref(), &ids, &[12]);
    let tail = full.slice_axis(1, 10, 12).unwrap();
    assert!(max_abs_diff(&tail, &next) < 1e-4);
}

/// On the CPU a GGUF's affine blocks stay packed for the shim's product: SmolLM2's Q4_1 file
/// (MLX's reader) reads about its own size a token, not float32's five times that (its greedy
/// ids against mlx-lm are the parity suite's), and the K-quant Llama (the host's reader: its
/// Q4_0/Q4_1/Q8_0/Q4_K matrices repacked) reads less than dequantized and gives the
/// dequantized load's logits within float32 summation error. Needs the fixtures
/// (`scripts/test-fixtures.sh`: HOST_TEST_GGUF, HOST_TEST_MODELS).
#[test]
fn gguf_blocks_stay_packed_on_the_cpu() {
    if mlx::Device::default_device() != mlx::Device::Cpu {
        return;
    }
    let (Some(gguf), Some(models)) = (std::env::var_os("HOST_TEST_GGUF"), std::env::var_os("HOST_TEST_MODELS")) else {
        eprintln!("skipped: no GGUF fixtures (eval \"$(scripts/test-fixtures.sh)\")");
        return;
    };
    let smollm2 = crate::load(Path::new(&gguf)).unwrap();
    let (read, file) = (smollm2.info.weight_bytes_per_token, std::fs::metadata(&gguf).unwrap().len() as usize);
    assert!(read < file * 3 / 2, "SmolLM2's Q4_1 file reads {read} bytes a token, the file is {file}");

    let kquant = Path::new(&models).join("kquant-llama.gguf");
    let packed = crate::load(&kquant).unwrap();
    let dense =
        crate::load_with(&kquant, &crate::LoadOptions { dequantize_gguf: Some(true), ..Default::default() }).unwrap();
    let (p, d) = (packed.info.weight_bytes_per_token, dense.info.weight_bytes_per_token);
    assert!(p < d * 9 / 10, "the K-quant Llama reads {p} bytes a token packed, {d} dense");
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 200 + 2).collect();
    let (a, b) = (last_logits(&packed, &ids), last_logits(&dense, &ids));
    let largest = b.to_vec_f32().unwrap().iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = max_abs_diff(&a, &b);
    assert!(diff <= 1e-5 * largest.max(10.0), "packed logits differ from dequantized ones by {diff}");
}
