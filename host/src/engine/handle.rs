//! The server's handle on the engine thread: `Engine::start` loads the model on a thread of
//! its own (MLX arrays never leave it), `submit` queues a request and returns its events,
//! `stop_now` ends everything at shutdown.

use super::job::{Event, Job, JobRequest, SubmitError};
use super::prompt_cache::PromptCache;
use super::scheduler::MakePolicy;
use super::stats::EngineStats;
use super::warm_up::warm_up;
use super::worker::{Models, Worker};
use crate::load::{load_draft, load_model_split, select_device, DeviceChoice, Split};
use anyhow::{Context, Result};
use mlx::{memory, Device};
use models::{ModelInfo, Tokenizer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// How the engine thread is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model: Option<PathBuf>,
    pub device: DeviceChoice,
    /// Jobs waiting beyond the running one; more are refused.
    pub queue_limit: usize,
    pub prompt_cache_bytes: usize,
    pub prefill_step_size: usize,
    /// Most requests decoded at once (rows of the batch and requests decoding alone).
    pub max_batch: usize,
    /// Prompt tokens prefilled between two batch steps, less one per running row: a long
    /// prompt joins in chunks instead of stalling the streams already running.
    pub step_token_budget: usize,
    /// A draft model for speculative decoding (checked against the model's tokenizer).
    pub draft_model: Option<PathBuf>,
    /// The scheduling policy (the server's: its scheduler plugin); `None`: first come,
    /// first served.
    pub policy: Option<MakePolicy>,
    /// How the model is split over ranks (default: not at all).
    pub split: Split,
    /// Run short generations before serving so the device compiles its kernels then, not in
    /// the first requests (`None`: on GPUs only).
    pub warm_up: Option<bool>,
}

impl EngineConfig {
    /// `model` on the CPU with small limits and nothing optional (plugins, draft, scheduler,
    /// tensor parallelism, warm-up) turned on: the base that tests adjust.
    pub fn cpu(model: PathBuf) -> EngineConfig {
        EngineConfig {
            model: Some(model),
            device: DeviceChoice::Cpu,
            queue_limit: 4,
            prompt_cache_bytes: 1 << 20,
            prefill_step_size: 64,
            max_batch: 8,
            step_token_budget: 512,
            draft_model: None,
            policy: None,
            split: Split::default(),
            warm_up: Some(false),
        }
    }
}

/// The server's handle on the engine thread.
pub struct Engine {
    /// `None` once the engine is shutting down.
    jobs: Mutex<Option<SyncSender<Job>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    pub tokenizer: Arc<Tokenizer>,
    pub info: ModelInfo,
    pub device: Device,
    pub stats: Arc<EngineStats>,
    /// Bytes of memory held once the model is loaded (weights and runtime), and, when the
    /// warm-up ran, the most a step needed beyond them.
    pub baseline_memory: usize,
    /// Whether a draft model is loaded (requests may ask for `draft` speculation).
    pub has_draft: bool,
    /// How long the warm-up took, if one ran.
    pub warmed_up: Option<Duration>,
    queue_limit: usize,
    max_batch: usize,
    next_seq: std::sync::atomic::AtomicU64,
    /// The sequence tokens whose KV fits the server's memory budget (0: not set, no limit):
    /// a request is paused only if it, the other paused ones and the one it yields to fit.
    kv_budget_tokens: Arc<AtomicUsize>,
    /// Set by `stop_now`: the engine thread ends every request and exits after its step.
    abort: Arc<AtomicBool>,
}

impl Engine {
    /// Starts the engine thread and waits until the model is loaded.
    pub fn start(config: EngineConfig) -> Result<Engine> {
        if config.max_batch == 0 || config.step_token_budget == 0 {
            anyhow::bail!("the engine needs max_batch and step_token_budget of at least 1");
        }
        // Room for the waiting requests and for a burst that fills the free rows.
        let (jobs, rx) = sync_channel::<Job>(config.queue_limit.saturating_add(config.max_batch).max(1));
        let (queue_limit, max_batch) = (config.queue_limit, config.max_batch);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(EngineStats::default());
        let thread_stats = stats.clone();
        let has_draft = config.draft_model.is_some();
        let kv_budget_tokens = Arc::new(AtomicUsize::new(0));
        let thread_budget = kv_budget_tokens.clone();
        let abort = Arc::new(AtomicBool::new(false));
        let thread_abort = abort.clone();
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let loaded = (|| -> Result<_> {
                    let device = select_device(config.device)?;
                    let loaded = load_model_split(config.model.as_deref(), &config.split, config.device)?;
                    let draft = config.draft_model.as_deref().map(|p| load_draft(p, &loaded)).transpose()?;
                    let mut warmed = None;
                    let mut working = 0;
                    if config.warm_up.unwrap_or(device == Device::Gpu) {
                        memory::reset_peak();
                        let took = warm_up(
                            loaded.model.as_ref(),
                            draft.as_ref().map(|d| d.model.as_ref()),
                            loaded.info.vocab_size,
                            config.prefill_step_size,
                            config.max_batch,
                        )?;
                        // What a step needs beyond the weights (activations; on GPUs, the
                        // dequantized copies of quantized weights for batches, which MLX
                        // frees only when the step's work completes) is kept out of the KV
                        // budget: the warm-up ran batches up to `max_batch`.
                        working = memory::peak().saturating_sub(memory::active());
                        tracing::info!(
                            ms = took.as_millis() as u64,
                            step_working_bytes = working,
                            "warm-up done (kernels compiled)"
                        );
                        warmed = Some(took);
                    }
                    Ok((device, loaded, draft, warmed, working))
                })();
                match loaded {
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                    Ok((device, loaded, draft, warmed, working)) => {
                        let tokenizer = Arc::new(loaded.tokenizer);
                        let baseline = memory::active() + working;
                        let _ = ready_tx.send(Ok((tokenizer.clone(), loaded.info.clone(), device, baseline, warmed)));
                        let policy = config.policy.as_ref().map(|make| (make.0)());
                        let worker = Worker {
                            info: loaded.info,
                            cache: PromptCache::new(config.prompt_cache_bytes),
                            stats: thread_stats,
                            prefill_step_size: config.prefill_step_size,
                            max_batch: config.max_batch,
                            step_token_budget: config.step_token_budget,
                            policy,
                            kv_budget_tokens: thread_budget,
                            not_paused: None,
                            abort: thread_abort,
                        };
                        let draft = draft.map(|d| d.model);
                        let models =
                            Models { model: loaded.model.as_ref(), draft: draft.as_deref(), tokenizer: &tokenizer };
                        worker.run(models, rx);
                    }
                }
            })
            .context("spawning the engine thread")?;
        let (tokenizer, info, device, baseline_memory, warmed_up) =
            ready_rx.recv().context("the engine thread exited while loading the model")??;
        Ok(Engine {
            jobs: Mutex::new(Some(jobs)),
            thread: Mutex::new(Some(thread)),
            tokenizer,
            info,
            device,
            stats,
            baseline_memory,
            has_draft,
            warmed_up,
            queue_limit,
            max_batch,
            next_seq: Default::default(),
            kv_budget_tokens,
            abort,
        })
    }

    /// Sets how many sequence tokens of KV the memory budget holds (see `kv_budget_tokens`).
    pub fn set_kv_budget_tokens(&self, tokens: usize) {
        self.kv_budget_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Queues a job; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the job.
    pub fn submit(&self, request: JobRequest) -> std::result::Result<UnboundedReceiver<Event>, SubmitError> {
        let (events, rx) = unbounded_channel();
        let jobs = self.jobs.lock().expect("engine queue lock");
        let Some(jobs) = jobs.as_ref() else { return Err(SubmitError::Stopped) };
        // Jobs wait in the engine's own queue (where the policy orders them), so the limit
        // is counted here, not by the channel. It counts the requests that must wait: those
        // beyond the batch's free rows (a burst into free rows is not a queue).
        let depth = self.stats.queue_depth.fetch_add(1, Ordering::SeqCst);
        let free = self.max_batch.saturating_sub(self.stats.running.load(Ordering::SeqCst));
        if depth >= self.queue_limit.saturating_add(free) {
            self.stats.queue_depth.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(depth));
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        match jobs.try_send(Job { request, events, seq, arrived: Instant::now() }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.stats.queue_depth.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull(self.stats.queue_depth.load(Ordering::SeqCst)),
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Stops the engine now (the server's grace period is over): requests still running or
    /// waiting end with a `Cancel { shutdown: true }`, and the engine thread exits after its
    /// current step, so no MLX work outlives it when the process exits (MLX's allocator and
    /// the BLAS library's threads go at exit: a step running then failed with `bad_alloc`
    /// or hung the exit). Waits up to `wait`; returns whether the thread has stopped.
    pub fn stop_now(&self, wait: Duration) -> bool {
        self.jobs.lock().map(|mut j| j.take()).ok();
        self.abort.store(true, Ordering::SeqCst);
        // The handle stays in place until the thread has finished, so a second caller (the
        // grace period's timer and the server's own end both stop the engine) waits for the
        // same thread instead of finding no handle and reporting it stopped.
        let deadline = Instant::now() + wait;
        loop {
            let finished = match self.thread.lock() {
                Ok(mut slot) => match slot.as_ref() {
                    None => return true,
                    Some(t) if t.is_finished() => slot.take(),
                    Some(_) => None,
                },
                Err(_) => return false,
            };
            if let Some(thread) = finished {
                let _ = thread.join();
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Stops the engine thread and waits for it: the model's MLX arrays are freed on that thread
/// before the process goes on to exit (MLX's static state must outlive them; a process that
/// exits while the thread still frees arrays can abort).
impl Drop for Engine {
    fn drop(&mut self) {
        self.jobs.lock().map(|mut j| j.take()).ok();
        if let Some(thread) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = thread.join();
        }
    }
}
