//! Speculative decoding through `host generate`, on real model folders: the output is token
//! for token the plain output (greedy and seeded sampling) with both drafters, on SmolLM2
//! with its layer-truncated draft (`../shared/models/make-layer-draft.py`) and on the tiny
//! random models; a draft with another vocabulary is refused with a clear error.
//!
//! Gated like `parity.rs` by the environment `eval "$(scripts/test-fixtures.sh)"` sets.

use super::common;

use common::{generate, models, run};
use std::path::Path;

/// The "edit this file" prompt of `bench/speculative.py`: prompt lookup has a lot to draft.
const EDIT: &str = include_str!("../bench/edit_prompt.txt");
const CHAT: &str = "Write a short story about a lighthouse keeper.";

/// Plain and speculative runs of the same request give the same ids; returns the
/// speculative runs' (drafted, accepted, candidate rows) totals: prompt lookup, draft model,
/// prompt lookup with four candidates.
fn check_identical(
    model: &Path,
    draft: &Path,
    prompts: &[&str],
    max_tokens: usize,
    sampling: &[&str],
) -> Vec<(u64, u64, u64)> {
    let draft = draft.to_str().unwrap();
    let mut totals = vec![(0, 0, 0); 3];
    for prompt in prompts {
        let plain = generate(model, prompt, max_tokens, sampling);
        // Prompt lookup with one candidate (the CPU's default), a draft model, and prompt
        // lookup verifying four candidates per step as one batch (greedy only; otherwise
        // it falls back to one).
        let spec_args: [&[&str]; 3] = [
            &["--speculative", "prompt-lookup"],
            &["--draft-model", draft],
            &["--speculative", "prompt-lookup", "--draft-candidates", "4"],
        ];
        for (i, spec) in spec_args.iter().enumerate() {
            let args: Vec<&str> = sampling.iter().chain(spec.iter()).copied().collect();
            let v = generate(model, prompt, max_tokens, &args);
            assert_eq!(v["token_ids"], plain["token_ids"], "{}: {args:?} on {prompt:?}", model.display());
            assert_eq!(v["text"], plain["text"]);
            totals[i].0 += v["drafted_tokens"].as_u64().unwrap();
            totals[i].1 += v["accepted_tokens"].as_u64().unwrap();
            totals[i].2 += v["candidate_rows"].as_u64().unwrap();
        }
    }
    totals
}

#[test]
fn smollm2_speculative_greedy_output_is_the_plain_output() {
    let Some(m) = models() else { return };
    let totals = check_identical(&m.join("smollm2-f32"), &m.join("smollm2-draft8"), &[EDIT, CHAT], 64, &[]);
    for (method, (drafted, accepted, _)) in ["prompt-lookup", "draft", "prompt-lookup x4"].iter().zip(&totals) {
        assert!(*drafted > 0, "{method}: nothing drafted");
        eprintln!("{method}: {accepted}/{drafted} accepted");
    }
    assert_eq!((totals[0].2, totals[1].2), (0, 0), "one candidate unless asked for more");
    assert!(totals[2].2 > 0, "--draft-candidates 4 verified several candidates as one batch");
    assert!(totals_accepted(&m), "prompt lookup accepts drafts on the edit workload");
}

fn totals_accepted(m: &Path) -> bool {
    let v = generate(&m.join("smollm2-f32"), EDIT, 64, &["--speculative", "prompt-lookup"]);
    v["accepted_tokens"].as_u64().unwrap() > 0 && v["tokens_per_step"].as_f64().unwrap() > 1.0
}

#[test]
fn smollm2_speculative_seeded_sampling_is_the_plain_output() {
    let Some(m) = models() else { return };
    let sampling = ["--temp", "0.8", "--top-p", "0.95", "--seed", "11"];
    check_identical(&m.join("smollm2-f32"), &m.join("smollm2-draft8"), &[EDIT], 48, &sampling);
}

#[test]
fn tiny_random_models_speculative_greedy_output_is_the_plain_output() {
    let Some(m) = models() else { return };
    // Each target drafted by a different tiny model of the same tokenizer.
    for (target, draft) in [
        ("tiny-llama", "tiny-qwen2"),
        ("tiny-qwen2", "tiny-llama3"),
        ("tiny-qwen3", "tiny-llama"),
        ("tiny-qwen3-q4", "tiny-qwen3"),
        // Gemma 3's sliding-window layers, past their window (16), rolled back by trim.
        ("tiny-gemma3", "tiny-qwen3"),
        ("tiny-gemma3-q4", "tiny-gemma3"),
        // A mixture of experts: a verification routes several tokens at once.
        ("tiny-qwen3-moe", "tiny-qwen3"),
        ("tiny-qwen3-moe-q4", "tiny-qwen3-moe"),
        ("tiny-qwen2-moe", "tiny-qwen2"),
        // Sinks, sliding layers and experts together.
        ("tiny-gpt-oss", "tiny-qwen3"),
        ("tiny-gpt-oss-q4", "tiny-gpt-oss"),
        ("tiny-phi3", "tiny-llama"),
        ("tiny-mistral-swa", "tiny-llama"),
        // Positions past the query scale's original context, rolled back and redone.
        ("tiny-ministral3", "tiny-llama"),
        ("tiny-ministral3-q4", "tiny-ministral3"),
        // Shared keys and per-layer inputs over a verified window, rolled back.
        ("tiny-gemma4", "tiny-llama"),
        ("tiny-gemma4-moe-q4", "tiny-gemma4-moe"),
    ] {
        let totals = check_identical(&m.join(target), &m.join(draft), &[EDIT, CHAT], 32, &[]);
        assert!(totals[1].0 > 0, "{target}: the draft model drafted nothing");
    }
}

/// Qwen3.5's recurrent layers under speculation: a rejected draft rolls the target's state
/// (and a hybrid draft model's own) back to its snapshot at the last accepted position. Its
/// 4-bit copy drafts for it, so steps accept some drafts and reject others; a hybrid MoE is
/// drafted by the dense one.
#[test]
fn a_hybrid_recurrent_models_speculative_output_is_the_plain_output_through_partial_rollbacks() {
    let Some(m) = models() else { return };
    for (target, draft) in [("tiny-qwen3_5", "tiny-qwen3_5-q4"), ("tiny-qwen3_5-moe", "tiny-qwen3_5")] {
        let totals = check_identical(&m.join(target), &m.join(draft), &[EDIT, CHAT], 32, &[]);
        let (drafted, accepted, _) = totals[1];
        assert!(drafted > accepted, "{target}: no draft was rejected ({accepted} of {drafted})");
        if target == "tiny-qwen3_5" {
            assert!(accepted > 0, "{target}: its 4-bit copy drafted nothing it accepted");
        }
    }
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let Some(m) = models() else { return };
    let dir = std::env::temp_dir().join(format!("host-spec-byte-draft-{}", std::process::id()));
    models::testing::write_model(&dir, "llama", 1).unwrap();
    let out = run(&m.join("smollm2-f32"), "hi", 4, &["--draft-model", dir.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("vocabulary of 258 tokens but the model") && err.contains("49152"), "{err}");
    assert!(err.contains("same tokenizer"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
    // --speculative draft without a draft model is a usage error.
    let out = run(&m.join("tiny-llama"), "hi", 4, &["--speculative", "draft"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --draft-model"));
}
