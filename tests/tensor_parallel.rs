//! Tensor and pipeline parallelism through `host generate --tensor-parallel N` and
//! `--pipeline-parallel N` on the CPU (MLX's ring backend over loopback, one process per
//! rank): the greedy tokens equal one rank's on the tiny random models (2 ranks) and SmolLM2
//! (3 tensor-parallel ranks: its 3 KV heads do not divide by 2; 4 uneven pipeline stages);
//! speculative decoding, whose rollbacks trim every rank's cache, stays identical too; a
//! split the model does not allow is refused, saying what would work.
//!
//! Gated like `parity.rs` by the environment `eval "$(scripts/test-fixtures.sh)"` sets.

use super::common;

use common::{generate, models, run, run_with};
use serde_json::Value;

fn ids(model: &std::path::Path, prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    generate(model, prompt, max_tokens, extra)["token_ids"].clone()
}

#[test]
fn two_ranks_give_one_ranks_greedy_tokens_on_the_tiny_models() {
    let Some(dir) = models() else { return };
    for name in ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"] {
        let model = dir.join(name);
        let one = ids(&model, "The quick brown fox", 24, &[]);
        assert_eq!(one.as_array().unwrap().len(), 24, "{name}");
        assert_eq!(ids(&model, "The quick brown fox", 24, &["--tensor-parallel", "2"]), one, "{name}");
    }
}

#[test]
fn three_ranks_give_one_ranks_greedy_tokens_on_smollm2() {
    let Some(dir) = models() else { return };
    let model = dir.join("smollm2-f32");
    let prompt = "Name three planets and one fact about each.";
    let one = ids(&model, prompt, 24, &[]);
    assert_eq!(ids(&model, prompt, 24, &["--tensor-parallel", "3"]), one);
}

#[test]
fn speculative_rollbacks_stay_identical_across_ranks() {
    let Some(dir) = models() else { return };
    let model = dir.join("tiny-qwen2");
    // Repetitive text without a chat template around it: prompt lookup drafts its
    // continuation, and the random model rejects most of it.
    let prompt = "one two three four one two three four one two three four one two";
    let one = ids(&model, prompt, 32, &["--raw"]);
    let out = run(&model, prompt, 32, &["--raw", "--tensor-parallel", "2", "--speculative", "prompt-lookup"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let split: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(split["token_ids"], one);
    // Drafts were rejected, so every rank trimmed its cache.
    assert!(split["drafted_tokens"].as_u64().unwrap() > split["accepted_tokens"].as_u64().unwrap(), "{split}");
}

#[test]
fn pipeline_stages_give_one_ranks_greedy_tokens_and_roll_back_together() {
    let Some(dir) = models() else { return };
    for name in ["tiny-llama3", "tiny-qwen3"] {
        let model = dir.join(name);
        let one = ids(&model, "The quick brown fox", 24, &[]);
        assert_eq!(ids(&model, "The quick brown fox", 24, &["--pipeline-parallel", "2"]), one, "{name}");
    }
    // SmolLM2's 30 layers in stages of 8, 8, 7 and 7; prompt lookup's rejected drafts trim
    // every stage's caches.
    let model = dir.join("smollm2-f32");
    let prompt = "one two three four one two three four one two three four one two";
    let one = ids(&model, prompt, 24, &["--raw"]);
    let out = run(&model, prompt, 24, &["--raw", "--pipeline-parallel", "4", "--speculative", "prompt-lookup"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let split: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(split["token_ids"], one);
    assert!(split["drafted_tokens"].as_u64().unwrap() > split["accepted_tokens"].as_u64().unwrap(), "{split}");
}

#[test]
fn stages_of_shards_give_one_ranks_greedy_tokens_in_whatever_order_mlx_runs_a_graph() {
    let Some(dir) = models() else { return };
    // Two stages of three shards (heads that split three ways): the middle shard of each
    // stage both sends and receives in every sum. MLX's `recv` has no inputs, so MLX may
    // schedule it anywhere in a step's graph; with MLX_BFS_MAX_WIDTH=1 it schedules a shard's
    // wait for the total before its own send of the partial sum (and the ranks hang) unless
    // each receive is ordered after this rank's part (`recv_after`).
    let model = dir.join("tiny-llama-thirds");
    let one = ids(&model, "The quick brown fox", 12, &[]);
    let split = ["--pipeline-parallel", "2", "--tensor-parallel", "3"];
    let out = run_with(&model, "The quick brown fox", 12, &split, &[("MLX_BFS_MAX_WIDTH", "1")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["token_ids"], one);
}

#[test]
fn a_pipeline_the_model_cannot_take_is_refused_before_launching() {
    let Some(dir) = models() else { return };
    let refusal = |model: &str, extra: &[&str]| {
        let out = run(&dir.join(model), "hi", 2, extra);
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refusal("tiny-llama", &["--pipeline-parallel", "3"]);
    assert!(err.contains("a pipeline of 3 ranks needs at least 3 layers; this model has 2"), "{err}");
    let err = refusal("tiny-gemma3", &["--pipeline-parallel", "2"]);
    assert!(err.contains("pipeline parallelism over gemma3_text is not supported yet"), "{err}");
    // Stages of shards: each stage's shards must divide the heads as a tensor-parallel split does.
    let err = refusal("tiny-llama", &["--pipeline-parallel", "2", "--tensor-parallel", "3"]);
    assert!(
        err.contains("tensor parallelism over 3 ranks needs the model's key/value heads (2) to divide by 3"),
        "{err}"
    );
}

#[test]
fn a_split_the_heads_do_not_allow_is_refused_before_launching() {
    let Some(dir) = models() else { return };
    let out = run(&dir.join("smollm2-f32"), "hi", 2, &["--tensor-parallel", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs the model's key/value heads (3) to divide by 2; this model can use 1, 3 ranks"),
        "{err}"
    );
    assert!(!err.contains("rank 1"), "no worker should have started: {err}");
}

/// A worker whose rank 0 is gone before the group formed exits instead of waiting for its
/// peers forever (an orphaned rank once held a test's stderr pipe open and hung it). The
/// worker is started by a shell that exits at once (likely before the worker first looks at
/// its parent), as a rank 0 that died would; the group's other ranks never come.
#[test]
fn a_worker_whose_rank_0_is_gone_before_joining_exits() {
    let dir = std::env::temp_dir().join(format!("host-tp-orphan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hostfile.json");
    std::fs::write(&hostfile, r#"[["127.0.0.1:9"],["127.0.0.1:23452"],["127.0.0.1:23453"]]"#).unwrap();
    let err = dir.join("stderr");
    let launch = format!(
        "'{}' tp-worker --rank 1 --size 3 --model /nonexistent --device cpu --control 127.0.0.1:9 --parent $$ >/dev/null 2>'{}' & echo $!",
        env!("CARGO_BIN_EXE_host"),
        err.display()
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &launch])
        .env("MLX_RANK", "1")
        .env("MLX_HOSTFILE", &hostfile)
        .output()
        .unwrap();
    let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("the worker's pid");
    // Gone, or a zombie nobody reaps (a container's pid 1 may not).
    let exited = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !exited() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    if !exited() {
        let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(stderr.contains("rank 0 (process") && stderr.contains("is gone; exiting"), "worker {pid}: {stderr}");
}
