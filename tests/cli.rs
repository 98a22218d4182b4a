//! `host generate` as a user runs it: the real binary on a tiny model folder written by the
//! test (no network, no fixtures): output shapes, determinism, and clear errors on bad input.

use super::common;

use common::{OutputWithin, HANG};
use serde_json::Value;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

fn model_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("host-cli-test-{}", std::process::id()));
        models::testing::write_model(&dir, "qwen3", 5).unwrap();
        dir
    })
}

fn host(args: &[&OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_host")).arg("generate").args(args).output_within(HANG)
}

fn generate(extra: &[&str]) -> Output {
    let mut args: Vec<&OsStr> =
        vec![OsStr::new("--model"), model_dir().as_os_str(), OsStr::new("--device"), OsStr::new("cpu")];
    args.extend(extra.iter().map(OsStr::new));
    host(&args)
}

fn json_of(out: &Output) -> Value {
    assert!(out.status.success(), "host failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

fn stderr_of_failure(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "expected failure, stdout: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn json_output_has_the_documented_fields() {
    let v = json_of(&generate(&["--prompt", "hello", "--max-tokens", "5", "--json"]));
    let ids = v["token_ids"].as_array().unwrap();
    assert!(!ids.is_empty() && ids.len() <= 5);
    assert!(v["prompt_token_ids"].as_array().unwrap().len() > 5, "the chat template wraps the prompt");
    assert_eq!(v["prompt_token_ids"][0], 0, "starts with <|im_start|>");
    assert!(["stop", "length"].contains(&v["finish_reason"].as_str().unwrap()));
    for key in ["prompt_tps", "generation_tps", "peak_memory_bytes", "seed"] {
        assert!(v[key].is_number(), "{key} missing: {v}");
    }
    assert!(v["text"].is_string());
    let raw = json_of(&generate(&["--prompt", "hello", "--max-tokens", "5", "--json", "--raw"]));
    assert_eq!(raw["prompt_token_ids"].as_array().unwrap().len(), 5, "raw: one byte token per letter");
}

#[test]
fn the_same_seed_gives_the_same_output_across_processes() {
    let run = |seed: &str| {
        json_of(&generate(&["--prompt", "hi", "--max-tokens", "12", "--json", "--temp", "1.0", "--seed", seed]))
    };
    let (a, b, c) = (run("3"), run("3"), run("4"));
    assert_eq!(a["token_ids"], b["token_ids"]);
    assert_eq!(a["seed"], 3);
    assert_ne!(a["token_ids"], c["token_ids"]);
}

#[test]
fn streamed_text_equals_the_json_text() {
    let json = json_of(&generate(&["--prompt", "abc", "--max-tokens", "10", "--json", "--seed", "1", "--temp", "0.7"]));
    let out = generate(&["--prompt", "abc", "--max-tokens", "10", "--seed", "1", "--temp", "0.7"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{}\n", json["text"].as_str().unwrap()));
    let stats = String::from_utf8_lossy(&out.stderr);
    assert!(stats.contains("tok/s") && stats.contains("peak memory"), "{stats}");
}

/// `--regex`, `--json-schema`: the output holds to them; the tokens they force (on this
/// byte-level vocabulary, every byte a regex's literal or a schema's key spells) are counted.
#[test]
fn generate_holds_its_output_to_a_regex_or_a_json_schema() {
    let v = json_of(&generate(&["--prompt", "hi", "--max-tokens", "20", "--json", "--regex", "[ab]{2}-done"]));
    let text = v["text"].as_str().unwrap();
    assert!(text.len() == 7 && text[..2].bytes().all(|b| b == b'a' || b == b'b') && text.ends_with("-done"), "{v}");
    assert!(v["forced_tokens"].as_u64().unwrap() >= 5, "\"-done\" is forced: {v}");
    assert_eq!(v["finish_reason"], "stop", "{v}");
    let dir = std::env::temp_dir().join(format!("host-cli-schema-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let schema = dir.join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"kind": {"enum": ["cat"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["kind", "n"], "additionalProperties": false}"#,
    )
    .unwrap();
    let v = json_of(&generate(&[
        "--prompt",
        "hi",
        "--max-tokens",
        "40",
        "--json",
        "--json-schema",
        schema.to_str().unwrap(),
    ]));
    let out: Value = serde_json::from_str(v["text"].as_str().unwrap()).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert_eq!(out["kind"], "cat", "{v}");
    assert!((0..=9).contains(&out["n"].as_i64().unwrap()), "{v}");
    assert!(v["forced_tokens"].as_u64().unwrap() >= 10, "the keys and \"cat\" are forced: {v}");
    // A schema that is not JSON, one llguidance refuses, and two structures at once.
    std::fs::write(&schema, "{not json").unwrap();
    let err = stderr_of_failure(&generate(&["--prompt", "hi", "--json-schema", schema.to_str().unwrap()]));
    assert!(err.contains("is not JSON; give --json-schema a file holding a JSON schema"), "{err}");
    std::fs::write(&schema, r#"{"type": "object", "not": {"required": ["a"]}}"#).unwrap();
    let err = stderr_of_failure(&generate(&["--prompt", "hi", "--json-schema", schema.to_str().unwrap()]));
    assert!(err.contains("--json-schema does not compile") && err.contains("not"), "{err}");
    let both = generate(&["--prompt", "hi", "--json-object", "--regex", "a"]);
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"), "{both:?}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_input_gets_a_clear_error() {
    let err = stderr_of_failure(&generate(&["--prompt", "hi", "--temp", "-1"]));
    assert!(err.contains("`temperature` must be between 0 and 100, got -1"), "{err}");
    let err = stderr_of_failure(&generate(&["--prompt", "hi", "--top-k", "999"]));
    assert!(err.contains("`top_k` must be below the vocabulary size 258"), "{err}");
    let err = stderr_of_failure(&generate(&["--prompt", "hi", "--max-tokens", "0"]));
    assert!(err.contains("--max-tokens must be at least 1"), "{err}");
    let err = stderr_of_failure(&host(&[
        OsStr::new("--model"),
        OsStr::new("/nonexistent/model"),
        OsStr::new("--prompt"),
        OsStr::new("x"),
    ]));
    assert!(err.contains("/nonexistent/model is neither a Hugging Face folder"), "{err}");
    let bad = [b'c', b'a', 0xff, b'!'];
    let err = stderr_of_failure(&host(&[
        OsStr::new("--model"),
        model_dir().as_os_str(),
        OsStr::new("--prompt"),
        OsStr::from_bytes(&bad),
    ]));
    assert!(err.contains("prompt is not valid UTF-8 (invalid byte at offset 2)"), "{err}");
}

#[test]
fn a_corrupt_config_names_the_file() {
    let dir = std::env::temp_dir().join(format!("host-cli-corrupt-{}", std::process::id()));
    models::testing::write_model(&dir, "llama", 6).unwrap();
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\", ").unwrap();
    let out = host(&[OsStr::new("--model"), dir.as_os_str(), OsStr::new("--prompt"), OsStr::new("x")]);
    let err = stderr_of_failure(&out);
    assert!(err.contains("config.json") && err.contains("not valid JSON"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bench_prints_one_json_row_per_prompt_length() {
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["bench", "--device", "cpu", "--json", "--prompt-lengths", "8,24", "--gen", "6", "--runs", "2"])
        .args(["--bandwidth", "10", "--model"])
        .arg(model_dir())
        .output_within(HANG);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    for (row, len) in rows.iter().zip([8, 24]) {
        assert_eq!(row["prompt_tokens"], len);
        assert_eq!(row["gen_tokens"], 6);
        for key in ["prefill_tps", "ttft_ms", "decode_tps", "peak_memory_bytes", "warmup_s"] {
            assert!(row[key].as_f64().unwrap() > 0.0, "{key}: {row}");
        }
        let per_token = row["weight_bytes_per_token"].as_f64().unwrap();
        assert!((row["floor_tps"].as_f64().unwrap() - 10e9 / per_token).abs() < 1e-6 * 10e9 / per_token);
        let pct = 100.0 * row["decode_tps"].as_f64().unwrap() / row["floor_tps"].as_f64().unwrap();
        assert!((row["pct_of_floor"].as_f64().unwrap() - pct).abs() < 1e-9);
        // The step split: the step is the median decode rate's, and each part of the first
        // run's pipelined steps was measured (tiny steps vary too much to compare sums).
        let step = row["step_ms"].as_f64().unwrap();
        assert!((step - 1e3 / row["decode_tps"].as_f64().unwrap()).abs() < 1e-9, "{row}");
        let parts: Vec<f64> =
            ["build_ms", "dispatch_ms", "wait_ms"].iter().map(|k| row[*k].as_f64().unwrap()).collect();
        assert!(parts[0] > 0.0 && parts[1] > 0.0 && parts[2] >= 0.0, "{row}");
    }
    let err = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["bench", "--gen", "1", "--model"])
        .arg(model_dir())
        .output_within(HANG);
    assert!(String::from_utf8_lossy(&err.stderr).contains("--gen must be at least 2"));
}

/// The two A/B aids that only the environment reaches: `HOST_DEBUG_STEP_GRAPH=FILE` writes a
/// decode step's graph (Graphviz), and in it `HOST_FUSE_PROJECTIONS=0` shows the separate
/// projections: 3 more matrix products per layer (q, k, v and gate, up as 5 instead of 2),
/// and, on a model without q/k norms (Llama), q and k rotated apart: a RoPE more per layer
/// (on the CPU the host's `HostCpuRope` node, or MLX's graph of plain ops with one `Sin`).
#[test]
fn the_step_graph_dump_shows_what_the_fusion_switch_changes() {
    let llama = std::env::temp_dir().join(format!("host-cli-test-llama-{}", std::process::id()));
    models::testing::write_model(&llama, "llama", 5).unwrap();
    for (dir, joint_rope) in [(model_dir(), false), (&llama, true)] {
        let count = |fuse: Option<&str>| {
            let path = std::env::temp_dir().join(format!("host-step-graph-{}-{fuse:?}.dot", std::process::id()));
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_host"));
            cmd.args(["bench", "--device", "cpu", "--json", "--prompt-lengths", "8", "--gen", "12", "--runs", "1"])
                .arg("--model")
                .arg(dir)
                .env("HOST_DEBUG_STEP_GRAPH", &path)
                .env_remove("HOST_FUSE_PROJECTIONS");
            if let Some(v) = fuse {
                cmd.env("HOST_FUSE_PROJECTIONS", v);
            }
            let out = cmd.output_within(HANG);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let dot = std::fs::read_to_string(&path).expect("the step graph was written");
            std::fs::remove_file(&path).ok();
            assert!(dot.starts_with("digraph"), "{}", &dot[..dot.len().min(200)]);
            // Products: MLX's matmuls and, on the CPU for a step's few rows, the host's own.
            let products = dot.matches("label =\"Matmul").count() + dot.matches("label =\"HostFewRowsMatmul").count();
            // RoPEs: the host's one node each on the CPU (MLX's own graph of plain ops has one `Sin`).
            let ropes = dot.matches("label =\"HostCpuRope").count() + dot.matches("label =\"Sin").count();
            (products, ropes)
        };
        let (fused, separate) = (count(None), count(Some("0")));
        let config: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
        assert_eq!(separate.0, fused.0 + 3 * layers, "{}: fused {fused:?}, separate {separate:?}", dir.display());
        let ropes = if joint_rope { layers } else { 0 };
        assert_eq!(separate.1, fused.1 + ropes, "{}: fused {fused:?}, separate {separate:?}", dir.display());
    }
    std::fs::remove_dir_all(llama).ok();
}

/// `host bench --json` with prompt lookup on `file` (12 tokens, 2 runs) and `extra` flags: its row.
fn bench_prompt_file(file: &std::path::Path, extra: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["bench", "--device", "cpu", "--json", "--gen", "12", "--runs", "2", "--speculative", "prompt-lookup"])
        .args(extra)
        .arg("--prompt-file")
        .arg(file)
        .arg("--model")
        .arg(model_dir())
        .output_within(HANG);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bench_measures_a_prompt_file_with_speculation() {
    let file = std::env::temp_dir().join(format!("host-bench-prompt-{}.txt", std::process::id()));
    std::fs::write(&file, "abcabcabcabcabcabc").unwrap();
    let row = bench_prompt_file(&file, &[]);
    assert_eq!(row["speculative"], "prompt-lookup");
    assert!(row["prompt_tokens"].as_u64().unwrap() > 18, "the chat template wraps the file: {row}");
    let ids = row["token_ids"].as_array().unwrap();
    assert_eq!(row["gen_tokens"].as_u64().unwrap() as usize, ids.len());
    assert!(!ids.is_empty() && ids.len() <= 12);
    assert_eq!(row["runs_identical"], true);
    assert!(row["first_decode_tps"].as_f64().unwrap() > 0.0, "{row}");
    // The file repeats itself, so the first step already finds something to verify.
    assert!(row["verifications"].as_u64().unwrap() > 0 && row["verify_ms"].as_f64().unwrap() > 0.0, "{row}");
    assert!(row["vs_plain"].is_null() && row["plain_decode_tps"].is_null(), "no plain runs unless asked: {row}");
    // Prompt lookup's ceiling on that text: at least one token per step, unbounded no lower.
    let (bounded, unbounded) =
        (row["lookup_ceiling"].as_f64().unwrap(), row["lookup_ceiling_unbounded"].as_f64().unwrap());
    assert!(bounded >= 1.0 && unbounded >= bounded, "{row}");
    // The same ids as `host generate` on the same prompt.
    let plain = json_of(&generate(&["--prompt", "abcabcabcabcabcabc", "--max-tokens", "12", "--json"]));
    assert_eq!(plain["token_ids"].as_array().unwrap(), ids);
    let missing = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["bench", "--prompt-file", "/nonexistent/prompt.txt", "--model"])
        .arg(model_dir())
        .output_within(HANG);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("reading /nonexistent/prompt.txt"));
    // Paired with plain runs in the same process: both speeds and their ratio are reported.
    let row = bench_prompt_file(&file, &["--paired-plain"]);
    let (plain_tps, vs_plain) = (row["plain_decode_tps"].as_f64().unwrap(), row["vs_plain"].as_f64().unwrap());
    assert!(plain_tps > 0.0 && vs_plain > 0.0, "{row}");
    assert_eq!(row["token_ids"].as_array().unwrap(), ids, "pairing changes nothing the speculative runs do");
    let refused = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["bench", "--paired-plain", "--model"])
        .arg(model_dir())
        .output_within(HANG);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--paired-plain compares speculation or a constraint"));
    // Under a constraint (a regex), speculative and paired with unconstrained plain runs: the
    // constraint's mask time and compile time are reported, and its output ends where the
    // regex does (the tiny model has no reason to stop at three letters otherwise).
    let constraint = std::env::temp_dir().join(format!("host-bench-constraint-{}.json", std::process::id()));
    std::fs::write(&constraint, r#"{"regex": "[abc]{3}"}"#).unwrap();
    let row = bench_prompt_file(&file, &["--paired-plain", "--constraint", constraint.to_str().unwrap()]);
    assert_eq!(row["constraint"], "regex", "{row}");
    let ids = row["token_ids"].as_array().unwrap();
    assert!((2..=4).contains(&ids.len()), "three letters then the end: {row}");
    assert!(row["mask_ms"].as_f64().unwrap() > 0.0 && row["masks_per_token"].as_f64().unwrap() >= 1.0, "{row}");
    assert!(row["trie_ms"].as_f64().unwrap() > 0.0 && row["compile_ms"].as_f64().unwrap() > 0.0, "{row}");
    assert!(row["vs_plain"].as_f64().unwrap() > 0.0, "{row}");
    // Where the time goes: the constraint's accepts, the masks applied on the device (those
    // sent among them), and the paired plain run's pipelined step (build / dispatch / wait).
    assert!(row["accept_ms"].as_f64().unwrap() > 0.0, "{row}");
    let (sent, applied) = (row["masks_sent"].as_u64().unwrap(), row["masks_applied"].as_u64().unwrap());
    assert!(sent >= 1 && sent <= applied, "{row}");
    let split: Vec<f64> = row["plain_step_split_ms"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert!(split.len() == 3 && split[1] > 0.0 && split.iter().all(|&ms| ms >= 0.0), "{row}");
    std::fs::remove_file(constraint).ok();
    // A constraint plugin (examples/wat/lowercase.wat) the same way: a mask per token, its
    // vocabulary and start timed.
    let dir = std::env::temp_dir().join(format!("host-bench-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let wat = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/wat/lowercase.wat");
    let built = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["plugins", "build-wat", wat])
        .arg(dir.join("lowercase.wasm"))
        .output_within(HANG);
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    std::fs::write(dir.join("lowercase.json"), r#"{"plugin": "lowercase.wasm"}"#).unwrap();
    let row =
        bench_prompt_file(&file, &["--paired-plain", "--constraint", dir.join("lowercase.json").to_str().unwrap()]);
    assert!(row["constraint"].as_str().unwrap().starts_with("plugin "), "{row}");
    assert!(row["mask_ms"].as_f64().unwrap() > 0.0 && row["masks_per_token"].as_f64().unwrap() >= 1.0, "{row}");
    assert!(row["trie_ms"].as_f64().unwrap() > 0.0 && row["compile_ms"].as_f64().unwrap() > 0.0, "{row}");
    assert_eq!(row["runs_identical"], true, "{row}");
    std::fs::remove_dir_all(dir).ok();
    std::fs::remove_file(file).ok();
}

/// `host bench --batch` with every row held to a constraint: each batch size's row reports
/// the rows' output length (where the regex ends them), their masks per mask and per step, and
/// the ratio to a plain batch run to the same lengths in the same process.
#[test]
fn bench_measures_constrained_batches_against_plain_ones_of_the_same_shape() {
    let file = std::env::temp_dir().join(format!("host-bench-batch-prompt-{}.txt", std::process::id()));
    std::fs::write(&file, "abcabcabcabcabcabc").unwrap();
    let constraint = std::env::temp_dir().join(format!("host-bench-batch-constraint-{}.json", std::process::id()));
    std::fs::write(&constraint, r#"{"regex": "[abc]{3}"}"#).unwrap();
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_host"))
            .args(["bench", "--device", "cpu", "--json", "--gen", "12", "--runs", "2", "--batch", "1,3", "--model"])
            .arg(model_dir())
            .args(extra)
            .output_within(HANG)
    };
    let out = bench(&["--prompt-file", file.to_str().unwrap(), "--constraint", constraint.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.iter().map(|r| r["batch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 3]);
    for row in &rows {
        assert_eq!(row["constraint"], "regex", "{row}");
        // Three letters then the end (the tiny model has no reason to stop there otherwise).
        let length = row["mean_row_tokens"].as_f64().unwrap();
        assert!((2.0..=4.0).contains(&length), "{row}");
        assert!(row["mask_ms"].as_f64().unwrap() > 0.0, "{row}");
        // A step masks every row: three rows' masks take longer a step than one mask.
        let (per_step, per_mask) = (row["mask_ms_per_step"].as_f64().unwrap(), row["mask_ms"].as_f64().unwrap());
        assert!(per_step > 0.0 && (row["batch"] == 1 || per_step > 1.5 * per_mask), "{row}");
        assert!(row["vs_plain"].as_f64().unwrap() > 0.0 && row["plain_decode_tps"].as_f64().unwrap() > 0.0, "{row}");
        // [abc] at each of the three letters, in every row: that mask goes to the device
        // once and is kept there (`Masking`), so fewer are sent than applied.
        let (sent, applied) = (row["masks_sent"].as_u64().unwrap(), row["masks_applied"].as_u64().unwrap());
        assert!(sent >= 1 && sent < applied, "{row}");
        // The engine thread's step split, of the constrained batch and of its plain pair:
        // build, dispatch, wait, tell, pick (only a constrained step samples apart).
        let split =
            |key: &str| -> Vec<f64> { row[key].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect() };
        let (held, plain) = (split("step_split_ms"), split("plain_step_split_ms"));
        // A merged step hands its forward to MLX with its sampling: its dispatch is in pick,
        // so the dispatch column is empty only when every step merged.
        let all_merged = row["merged_steps"] == row["steps"];
        assert!(held.len() == 5 && held[0] > 0.0 && (held[1] > 0.0 || all_merged) && held[4] > 0.0, "{row}");
        assert!(plain.len() == 5 && plain[0] > 0.0 && plain[1] > 0.0 && plain[4] == 0.0, "{row}");
        let (step, plain_step) = (row["step_ms"].as_f64().unwrap(), row["plain_step_ms"].as_f64().unwrap());
        assert!(step > 0.0 && plain_step > 0.0, "{row}");
    }
    // Plain batches of random prompts report no constraint; a constraint needs the prompt.
    let plain = bench(&[]);
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let row: Value = serde_json::from_str(String::from_utf8_lossy(&plain.stdout).lines().next().unwrap()).unwrap();
    assert!(row["constraint"].is_null() && row["vs_plain"].is_null(), "{row}");
    assert!(row["plain_step_split_ms"].is_null() && row["step_split_ms"][1].as_f64().unwrap() > 0.0, "{row}");
    let refused = bench(&["--constraint", constraint.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--batch takes --constraint and --prompt-file together"));
    std::fs::remove_file(constraint).ok();
    std::fs::remove_file(file).ok();
}

/// `host bench --batch --speculative`: every row speculates, each run paired with a plain
/// batch of the same rows; the rows verified drafts; a prompt file alone is refused.
#[test]
fn bench_measures_speculative_batches_against_plain_ones() {
    let file = std::env::temp_dir().join(format!("host-bench-spec-batch-{}.txt", std::process::id()));
    std::fs::write(&file, "abcabcabcabcabcabcabcabcabcabc").unwrap();
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_host"))
            .args(["bench", "--device", "cpu", "--json", "--gen", "12", "--runs", "2", "--batch", "1,3", "--model"])
            .arg(model_dir())
            .arg("--prompt-file")
            .arg(&file)
            .args(extra)
            .output_within(HANG)
    };
    let out = bench(&["--speculative", "prompt-lookup"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.iter().map(|r| r["batch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 3]);
    for row in &rows {
        assert_eq!(row["speculative"], "prompt-lookup", "{row}");
        assert!(row["vs_plain"].as_f64().unwrap() > 0.0 && row["plain_decode_tps"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["verifications"].as_u64().unwrap() > 0 && row["draft_tokens"].as_u64().unwrap() > 0, "{row}");
        assert!(row["verifications"].as_u64().unwrap() <= row["steps"].as_u64().unwrap(), "{row}");
        // Every verification fed each row its last token, its drafts and any padding.
        let n = |k: &str| row[k].as_u64().unwrap();
        let rows_fed = n("verify_positions") - n("verify_padding") - n("draft_tokens");
        assert!((n("verifications")..=n("verifications") * n("batch")).contains(&rows_fed), "{row}");
    }
    let refused = bench(&[]);
    assert!(String::from_utf8_lossy(&refused.stderr)
        .contains("--batch takes --prompt-file with --constraint or --speculative"));
    std::fs::remove_file(file).ok();
}

/// The deadline every run of the binary here has: a child that hangs fails its test, with its
/// stderr, instead of holding the suite until CI's time limit (a hang at exit did, once).
#[test]
#[should_panic(expected = "did not finish within 1 s and was killed (a hang); its stderr:\nstarted")]
fn a_hanging_child_fails_the_test_with_its_stderr() {
    Command::new("sh").args(["-c", "echo started >&2; sleep 30"]).output_within(std::time::Duration::from_secs(1));
}

/// `--model org/name` finds the model in a Hugging Face cache laid out as the hub's tools
/// write it (files in `blobs/`, the snapshot's entries links to them, `refs/main` the
/// commit) and generates what the folder itself gives; a name the cache lacks, with
/// `HF_HUB_OFFLINE=1`, is an error that names it and how to fetch it; `host models` lists it.
#[test]
fn a_hub_name_loads_from_the_hub_cache_and_a_missing_one_says_how_to_fetch_it() {
    let root = std::env::temp_dir().join(format!("host-cli-hub-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let repo = root.join("models--test-org--tiny-qwen3");
    let commit = "89abcdef0123456789abcdef0123456789abcdef";
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    for (i, entry) in std::fs::read_dir(model_dir()).unwrap().enumerate() {
        let entry = entry.unwrap();
        let blob = format!("{i:064x}");
        std::fs::copy(entry.path(), repo.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(entry.file_name())).unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    let run = |model: &str| {
        Command::new(env!("CARGO_BIN_EXE_host"))
            .args(["generate", "--device", "cpu", "--prompt", "hello", "--max-tokens", "6", "--json", "--model", model])
            .env("HF_HUB_CACHE", &root)
            .env("HF_HUB_OFFLINE", "1")
            .output_within(HANG)
    };
    let by_path = json_of(&generate(&["--prompt", "hello", "--max-tokens", "6", "--json"]));
    let by_name = json_of(&run("test-org/tiny-qwen3"));
    assert_eq!(by_name["token_ids"], by_path["token_ids"]);
    assert_eq!(json_of(&run(&format!("test-org/tiny-qwen3@{commit}")))["token_ids"], by_path["token_ids"]);
    let missing = stderr_of_failure(&run("test-org/absent"));
    assert!(missing.contains("test-org/absent") && missing.contains("HF_HUB_OFFLINE"), "{missing}");
    assert!(missing.contains("host pull test-org/absent"), "{missing}");
    let revision = stderr_of_failure(&run("test-org/tiny-qwen3@v9"));
    assert!(revision.contains("\"v9\"") && revision.contains("cached: main"), "{revision}");
    // `host models` lists it: its name, type and size on disk.
    let listed = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["models", "--json"])
        .env("HF_HUB_CACHE", &root)
        .output_within(HANG);
    let rows: Vec<Value> =
        String::from_utf8_lossy(&listed.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0]["name"].as_str(), rows[0]["model_type"].as_str()),
        (Some("test-org/tiny-qwen3"), Some("qwen3"))
    );
    assert!(rows[0]["bytes"].as_u64().unwrap() > 1000, "{}", rows[0]);
    std::fs::remove_dir_all(root).ok();
}
