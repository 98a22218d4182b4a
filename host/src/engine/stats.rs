//! The counters the engine keeps for `/metrics`, and a generation's own (`DecodeStats`).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Counters the engine keeps for `/metrics`.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub queue_depth: AtomicUsize,
    pub prompt_tokens: AtomicUsize,
    pub generation_tokens: AtomicUsize,
    pub cached_tokens: AtomicUsize,
    pub prompt_cache_bytes: AtomicUsize,
    pub prompt_cache_hits: AtomicUsize,
    pub active_memory: AtomicUsize,
    /// Requests decoding now (batch rows, prefilling and solo ones), and the batch's rows.
    pub running: AtomicUsize,
    pub batch_rows: AtomicUsize,
    /// Bytes of KV the batch holds (padding included).
    pub batch_kv_bytes: AtomicUsize,
    /// Running requests the policy paused for a waiting one.
    pub preemptions: AtomicUsize,
    /// Batch steps by rows: `batch_size_counts[i]` counts steps of at most `BATCH_SIZE_BUCKETS[i]`
    /// rows that exceed the bucket before it (the last bucket: everything above); and the
    /// rows of all steps summed.
    pub batch_size_counts: [AtomicUsize; BATCH_SIZE_BUCKETS.len() + 1],
    pub batch_rows_total: AtomicUsize,
    /// Speculative decoding: tokens drafted, drafts accepted, target forwards while decoding
    /// speculatively, and tokens those requests generated.
    pub spec_drafted_tokens: AtomicUsize,
    pub spec_accepted_tokens: AtomicUsize,
    pub spec_target_steps: AtomicUsize,
    pub spec_generated_tokens: AtomicUsize,
    /// The same drafted and accepted tokens by drafter (`SPEC_DRAFTERS`' order).
    pub spec_by_drafter: [[AtomicUsize; 2]; SPEC_DRAFTERS.len()],
    /// The batch's verification steps (speculative rows verified together) and the tokens
    /// they verified, summed over rows (draft tokens per step = this / those).
    pub batch_verifications: AtomicUsize,
    pub batch_draft_tokens: AtomicUsize,
    /// Tokens an output constraint forced and a request decoding alone committed in runs
    /// (`Generation::forced_run`: without sampling, many in one forward).
    pub forced_tokens: AtomicUsize,
    /// Prompt chunks prefilled in one forward with others (`step::prefill_together`).
    pub prefilled_together: AtomicUsize,
}

/// The drafters `EngineStats::spec_by_drafter` counts, by their names in requests.
pub const SPEC_DRAFTERS: [&str; 2] = ["prompt-lookup", "draft"];

/// Upper bounds of the batch-size histogram's buckets (`EngineStats::batch_size_counts`).
pub const BATCH_SIZE_BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

impl EngineStats {
    pub(super) fn batch_step(&self, rows: usize) {
        let bucket = BATCH_SIZE_BUCKETS.iter().position(|&b| rows <= b).unwrap_or(BATCH_SIZE_BUCKETS.len());
        self.batch_size_counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.batch_rows_total.fetch_add(rows, Ordering::Relaxed);
    }
}

/// Throughput and memory of a finished (or ongoing) generation, measured as mlx-lm does:
/// prompt time runs until the first token is ready, generation time from then on.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prompt_tps: f64,
    pub generation_tps: f64,
    pub peak_memory_bytes: usize,
    /// Target-model forwards after prefill (plain steps and speculative verifications).
    pub decode_steps: usize,
    /// Speculative decoding: tokens drafted and drafts accepted (of the candidate kept, when
    /// several were scored), and batch rows scored by steps that verified several candidates.
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    pub candidate_rows: usize,
    /// Where pipelined plain steps spend their time on the calling thread, summed: building
    /// the next step's graph, handing it to MLX (`async_eval`), and waiting for the current
    /// token (device time the CPU work did not hide).
    pub pipelined_steps: usize,
    pub build_secs: f64,
    pub dispatch_secs: f64,
    pub wait_secs: f64,
    /// Speculative verifications and their time, summed (draft, forward, accept, commit).
    pub verifications: usize,
    pub verify_secs: f64,
    /// Parts of `verify_secs`: drafting, building the verification's graph, handing it to MLX
    /// and waiting for its picks. The last three are split for one candidate picked by the
    /// native sampler (the common case); plugin and lossless verifications count their row-by-
    /// row reads in the rest, several-candidate ones all of it. The rest is accepting
    /// and committing.
    pub verify_draft_secs: f64,
    pub verify_build_secs: f64,
    pub verify_dispatch_secs: f64,
    pub verify_wait_secs: f64,
    /// A constrained generation: masks computed and the seconds the constraint took for
    /// them (on the CPU, while the step's forward runs).
    pub masks: usize,
    pub mask_secs: f64,
    /// Tokens told to the constraint, and the seconds that took (wherever it ran).
    pub accepts: usize,
    pub accept_secs: f64,
    /// Masks applied on the device, and of them those sent from the host (the rest were
    /// kept there from an earlier step: `Masking`).
    pub masks_applied: usize,
    pub masks_sent: usize,
    /// Constrained steps' samplings started by `queue_pick`, and the engine thread's seconds
    /// building and handing them to MLX: behind a forward already started (its own
    /// dispatch, the common case), or — a merged step's, a forced run's — with the forward
    /// it follows, whose building and dispatch it then includes.
    pub picks: usize,
    pub pick_secs: f64,
    /// Constrained steps whose mask was worked out beside the next forward's dispatch.
    pub overlapped_masks: usize,
    /// Constrained steps started as one dispatch (forward and sampling), the token before
    /// them already there and the mask worked out before it (`Generation::merged`).
    pub merged_steps: usize,
    /// Tokens the constraint forced (its mask allowed one), committed without sampling and
    /// fed to the model in runs (`Generation::forced_run`).
    pub forced_tokens: usize,
}

impl DecodeStats {
    /// Accepted drafts over drafted tokens (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.drafted_tokens as f64
        }
    }

    /// Generated tokens per target forward (1 without speculation).
    pub fn tokens_per_step(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            self.generated_tokens as f64 / self.decode_steps as f64
        }
    }
}
