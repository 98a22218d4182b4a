//! Prometheus text metrics: requests by route and status, time-to-first-token and
//! inter-token latency histograms, token counters, queue depth and prompt-cache figures.

use crate::engine::stats::{EngineStats, BATCH_SIZE_BUCKETS, SPEC_DRAFTERS};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

const LATENCY_BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Debug)]
struct Histogram {
    counts: [u64; LATENCY_BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    const fn new() -> Histogram {
        Histogram { counts: [0; LATENCY_BUCKETS.len()], sum: 0.0, count: 0 }
    }
    fn observe(&mut self, seconds: f64) {
        for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
            if seconds <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += seconds;
        self.count += 1;
    }
    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", self.counts[i]);
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics { requests: Mutex::default(), ttft: Mutex::new(Histogram::new()), itl: Mutex::new(Histogram::new()) }
    }
}

impl Metrics {
    pub fn request(&self, route: &str, status: u16) {
        *self.requests.lock().expect("metrics lock").entry((route.to_string(), status)).or_default() += 1;
    }
    pub fn time_to_first_token(&self, seconds: f64) {
        self.ttft.lock().expect("metrics lock").observe(seconds);
    }
    pub fn inter_token(&self, seconds: f64) {
        self.itl.lock().expect("metrics lock").observe(seconds);
    }

    pub fn render(&self, engine: &EngineStats) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP host_requests_total HTTP requests by route and status.\n# TYPE host_requests_total counter"
        );
        for ((route, status), n) in self.requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(out, "host_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        self.ttft.lock().expect("metrics lock").render(
            "host_time_to_first_token_seconds",
            "Time from request to first token.",
            &mut out,
        );
        self.itl.lock().expect("metrics lock").render(
            "host_inter_token_latency_seconds",
            "Time between streamed tokens.",
            &mut out,
        );
        let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed);
        let counters = [
            (
                "host_prompt_tokens_total",
                "counter",
                "Prompt tokens processed (including cached).",
                load(&engine.prompt_tokens),
            ),
            ("host_generation_tokens_total", "counter", "Tokens generated.", load(&engine.generation_tokens)),
            (
                "host_prompt_cache_tokens_total",
                "counter",
                "Prompt tokens served from the prompt cache.",
                load(&engine.cached_tokens),
            ),
            (
                "host_prompt_cache_hits_total",
                "counter",
                "Requests that reused a cached prefix.",
                load(&engine.prompt_cache_hits),
            ),
            ("host_prompt_cache_bytes", "gauge", "Bytes held by the prompt cache.", load(&engine.prompt_cache_bytes)),
            ("host_queue_depth", "gauge", "Requests waiting to start.", load(&engine.queue_depth)),
            (
                "host_requests_running",
                "gauge",
                "Requests decoding now (prefilling, batched or alone).",
                load(&engine.running),
            ),
            ("host_batch_rows", "gauge", "Rows of the decode batch.", load(&engine.batch_rows)),
            ("host_batch_kv_bytes", "gauge", "Bytes of KV the decode batch holds.", load(&engine.batch_kv_bytes)),
            (
                "host_preemptions_total",
                "counter",
                "Running requests the scheduling policy paused for a waiting one.",
                load(&engine.preemptions),
            ),
            (
                "host_active_memory_bytes",
                "gauge",
                "MLX active memory after the last request.",
                load(&engine.active_memory),
            ),
            (
                "host_spec_drafted_tokens_total",
                "counter",
                "Tokens drafted by speculative decoding.",
                load(&engine.spec_drafted_tokens),
            ),
            (
                "host_spec_accepted_tokens_total",
                "counter",
                "Drafted tokens the target model accepted (acceptance rate = accepted / drafted).",
                load(&engine.spec_accepted_tokens),
            ),
            (
                "host_spec_target_steps_total",
                "counter",
                "Target-model forwards of speculative requests while decoding.",
                load(&engine.spec_target_steps),
            ),
            (
                "host_spec_generation_tokens_total",
                "counter",
                "Tokens generated by speculative requests (tokens per target step = this / target steps).",
                load(&engine.spec_generated_tokens),
            ),
            (
                "host_spec_batch_verifications_total",
                "counter",
                "Batch steps that verified speculative rows' drafts together.",
                load(&engine.batch_verifications),
            ),
            (
                "host_spec_batch_draft_tokens_total",
                "counter",
                "Draft tokens those steps verified, summed over rows (draft tokens per step = this / verifications).",
                load(&engine.batch_draft_tokens),
            ),
            (
                "host_constraint_forced_tokens_total",
                "counter",
                "Tokens an output constraint forced, committed in runs by requests decoding alone (no sampling, one forward for a run).",
                load(&engine.forced_tokens),
            ),
            (
                "host_prefill_together_total",
                "counter",
                "Prompt chunks prefilled in one forward with other requests' (requests that arrived together).",
                load(&engine.prefilled_together),
            ),
        ];
        for (name, kind, help, value) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
        for (i, (name, help)) in [
            ("host_spec_drafter_drafted_tokens_total", "Tokens drafted, by drafter."),
            ("host_spec_drafter_accepted_tokens_total", "Drafted tokens accepted, by drafter."),
        ]
        .into_iter()
        .enumerate()
        {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (drafter, counts) in SPEC_DRAFTERS.iter().zip(&engine.spec_by_drafter) {
                let _ = writeln!(out, "{name}{{drafter=\"{drafter}\"}} {}", load(&counts[i]));
            }
        }
        let _ = writeln!(
            out,
            "# HELP host_batch_size Rows per decode step of the batch.\n# TYPE host_batch_size histogram"
        );
        let mut cumulative = 0;
        for (bound, count) in BATCH_SIZE_BUCKETS.iter().zip(&engine.batch_size_counts) {
            cumulative += load(count);
            let _ = writeln!(out, "host_batch_size_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        cumulative += load(&engine.batch_size_counts[BATCH_SIZE_BUCKETS.len()]);
        let _ = writeln!(
            out,
            "host_batch_size_bucket{{le=\"+Inf\"}} {cumulative}\nhost_batch_size_sum {}\nhost_batch_size_count {cumulative}",
            load(&engine.batch_rows_total)
        );
        out
    }
}
