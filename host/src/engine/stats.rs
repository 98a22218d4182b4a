//! The counters the engine keeps for `/metrics`.

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
    /// Tokens an output constraint forced and a request decoding alone committed in runs
    /// (`Generation::forced_run`: without sampling, many in one forward).
    pub forced_tokens: AtomicUsize,
}

/// Upper bounds of the batch-size histogram's buckets (`EngineStats::batch_size_counts`).
pub const BATCH_SIZE_BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

impl EngineStats {
    pub(super) fn batch_step(&self, rows: usize) {
        let bucket = BATCH_SIZE_BUCKETS.iter().position(|&b| rows <= b).unwrap_or(BATCH_SIZE_BUCKETS.len());
        self.batch_size_counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.batch_rows_total.fetch_add(rows, Ordering::Relaxed);
    }
}
