//! The engine thread: loads the model on its own thread (MLX arrays never leave it) and
//! serves generation jobs from a bounded queue, one at a time, streaming events back.
//! The async server never blocks on MLX: it submits a job and reads a channel.
//!
//! A job ends early when its event receiver is dropped (the client went away): the loop
//! notices at the next token and frees the job's cache.

use super::prompt_cache::PromptCache;
use super::stop::StopMatcher;
use super::{
    DecodeOptions, FinishReason, Generation, Hooks, Sampler, SamplingParams, SpecConfig, SpecMethod, Speculation,
};
use crate::generate::{load_draft, load_model, select_device, DeviceChoice};
use crate::plugins::runtime::{Instance, PluginFault, PluginRefused};
use crate::plugins::{PluginRegistry, PluginSampler, Selection};
use anyhow::{Context, Result};
use mlx::{memory, Array, Device};
use models::{CausalLm, Detokenizer, ModelInfo, Tokenizer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// How the engine thread is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model: Option<PathBuf>,
    pub device: DeviceChoice,
    /// Jobs waiting beyond the running one; more are refused.
    pub queue_limit: usize,
    pub prompt_cache_bytes: usize,
    pub prefill_step_size: usize,
    /// Plugins requests may select.
    pub plugins: Option<Arc<PluginRegistry>>,
    /// A draft model for speculative decoding (checked against the model's tokenizer).
    pub draft_model: Option<PathBuf>,
}

/// One generation request, as the server hands it to the engine.
#[derive(Debug, Clone)]
pub struct JobRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Return this many alternatives with each token's log-probability (`None`: no logprobs).
    pub top_logprobs: Option<usize>,
    /// Sampler and stop-rule plugins for this request.
    pub plugins: Selection,
    /// Speculative decoding for this request (`SpecMethod::Off` for none).
    pub speculative: SpecConfig,
}

/// A token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// Why a job finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token.
    Eos,
    /// A stop string matched (it is not part of the text).
    StopString(String),
    /// A stop-rule plugin ended generation.
    StopRule(String),
    Length,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            Finish::Eos | Finish::StopString(_) | Finish::StopRule(_) => "stop",
            Finish::Length => "length",
        }
    }
}

/// The byte index that leaves the last `keep` characters of `s` after it.
fn char_split(s: &str, keep: usize) -> usize {
    if keep == 0 {
        return s.len();
    }
    s.char_indices().rev().nth(keep - 1).map_or(0, |(i, _)| i)
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prompt cache.
    pub cached_tokens: usize,
    /// Set when the request decoded speculatively.
    pub speculative: Option<SpecUsage>,
}

/// How speculation went for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecUsage {
    pub method: SpecMethod,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    /// Target-model forwards while decoding (plain steps and verifications).
    pub target_steps: usize,
}

/// What a job reports, in order: `Started`, any number of `Delta`s, then `Done` or `Error`.
#[derive(Debug, Clone)]
pub enum Event {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// New text (possibly empty while a stop string or a character is unresolved) and the
    /// log-probabilities of the tokens that produced it, when asked for.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish: Finish,
        usage: Usage,
    },
    /// An internal failure; details are in the log.
    Error(String),
    /// The request's plugin config or params were refused (a client error).
    Refused(String),
    /// A plugin failed while serving this request; the message names it.
    PluginFault(String),
}

struct Job {
    request: JobRequest,
    events: UnboundedSender<Event>,
}

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
    /// Speculative decoding: tokens drafted, drafts accepted, target forwards while decoding
    /// speculatively, and tokens those requests generated.
    pub spec_drafted_tokens: AtomicUsize,
    pub spec_accepted_tokens: AtomicUsize,
    pub spec_target_steps: AtomicUsize,
    pub spec_generated_tokens: AtomicUsize,
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
    /// Bytes of memory held once the model is loaded (weights and runtime).
    pub baseline_memory: usize,
    /// Whether a draft model is loaded (requests may ask for `draft` speculation).
    pub has_draft: bool,
}

/// Why a job was not accepted.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull(usize),
    Stopped,
}

impl Engine {
    /// Starts the engine thread and waits until the model is loaded.
    pub fn start(config: EngineConfig) -> Result<Engine> {
        let (jobs, rx) = sync_channel::<Job>(config.queue_limit);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(EngineStats::default());
        let thread_stats = stats.clone();
        let has_draft = config.draft_model.is_some();
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let loaded = (|| -> Result<_> {
                    let device = select_device(config.device)?;
                    let loaded = load_model(config.model.as_deref())?;
                    let draft = config.draft_model.as_deref().map(|p| load_draft(p, &loaded)).transpose()?;
                    Ok((device, loaded, draft))
                })();
                match loaded {
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                    Ok((device, loaded, draft)) => {
                        let tokenizer = Arc::new(loaded.tokenizer);
                        let baseline = memory::active();
                        let _ = ready_tx.send(Ok((tokenizer.clone(), loaded.info.clone(), device, baseline)));
                        let worker = Worker {
                            plugins: config.plugins.clone(),
                            model: loaded.model,
                            draft: draft.map(|d| d.model),
                            tokenizer,
                            info: loaded.info,
                            cache: PromptCache::new(config.prompt_cache_bytes),
                            stats: thread_stats,
                            prefill_step_size: config.prefill_step_size,
                        };
                        worker.run(rx);
                    }
                }
            })
            .context("spawning the engine thread")?;
        let (tokenizer, info, device, baseline_memory) =
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
        })
    }

    /// Queues a job; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the job.
    pub fn submit(&self, request: JobRequest) -> std::result::Result<UnboundedReceiver<Event>, SubmitError> {
        let (events, rx) = unbounded_channel();
        let jobs = self.jobs.lock().expect("engine queue lock");
        let Some(jobs) = jobs.as_ref() else { return Err(SubmitError::Stopped) };
        self.stats.queue_depth.fetch_add(1, Ordering::SeqCst);
        match jobs.try_send(Job { request, events }) {
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

struct Worker {
    plugins: Option<Arc<PluginRegistry>>,
    model: Box<dyn CausalLm>,
    draft: Option<Box<dyn CausalLm>>,
    tokenizer: Arc<Tokenizer>,
    info: ModelInfo,
    cache: PromptCache,
    stats: Arc<EngineStats>,
    prefill_step_size: usize,
}

impl Worker {
    fn run(mut self, rx: Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            self.stats.queue_depth.fetch_sub(1, Ordering::SeqCst);
            if job.events.is_closed() {
                continue;
            }
            if let Err(e) = self.run_job(&job) {
                let event = if let Some(r) = e.chain().find_map(|c| c.downcast_ref::<PluginRefused>()) {
                    Event::Refused(r.0.clone())
                } else if let Some(f) = e.chain().find_map(|c| c.downcast_ref::<PluginFault>()) {
                    tracing::warn!("{}", f.0);
                    Event::PluginFault(f.0.clone())
                } else {
                    tracing::error!("generation failed: {e:#}");
                    Event::Error(format!("{e:#}"))
                };
                let _ = job.events.send(event);
            }
            self.stats.prompt_cache_bytes.store(self.cache.bytes(), Ordering::Relaxed);
            self.stats.active_memory.store(memory::active(), Ordering::Relaxed);
        }
    }

    fn run_job(&mut self, job: &Job) -> Result<()> {
        let request = &job.request;
        let prompt = &request.prompt;
        let (cache, reused) = match self.cache.take(prompt) {
            Some(r) => (r.cache, r.reused),
            None => (self.model.make_cache(), 0),
        };
        if reused > 0 {
            self.stats.prompt_cache_hits.fetch_add(1, Ordering::Relaxed);
        }
        let sampler = Sampler::new(request.sampling.clone(), self.info.vocab_size)?;
        let seed = sampler.seed();
        let options = DecodeOptions {
            max_tokens: request.max_tokens,
            eos_token_ids: self.info.eos_token_ids.clone(),
            prefill_step_size: self.prefill_step_size,
        };
        let (external, mut stop_rules) = self.start_plugins(&request.plugins, prompt, seed)?;
        let hold = stop_rules.iter().map(|(_, h, _)| *h).max().unwrap_or(0);
        let mut held = String::new();
        let speculation = match request.speculative.method {
            SpecMethod::Off => None,
            _ => Some(Speculation::new(
                request.speculative.clone(),
                prompt,
                self.draft.as_deref(),
                self.prefill_step_size,
            )?),
        };
        let hooks = Hooks { external, speculation };
        let mut generation =
            Generation::start_with(self.model.as_ref(), cache, &prompt[reused..], sampler, options, hooks)?;
        self.stats.prompt_tokens.fetch_add(prompt.len(), Ordering::Relaxed);
        self.stats.cached_tokens.fetch_add(reused, Ordering::Relaxed);
        if job.events.send(Event::Started { prompt_tokens: prompt.len(), cached_tokens: reused }).is_err() {
            return Ok(());
        }
        let mut detok = Detokenizer::new(&self.tokenizer);
        let mut stop = StopMatcher::new(&request.stop);
        let mut generated: Vec<u32> = Vec::new();
        let mut finish = None;
        while let Some(token) = generation.next_token()? {
            generated.push(token.id);
            self.stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
            let is_eos = token.finish == Some(FinishReason::Stop);
            let logprobs = match request.top_logprobs {
                Some(k) => vec![self.logprob(&token.logprobs, token.id, k)?],
                None => vec![],
            };
            let mut text = String::new();
            if !is_eos {
                let mut piece = detok.push(token.id)?;
                // Stop-rule plugins see raw text; the last `hold` characters wait for them.
                let mut faulted = None;
                for (i, (rule, _, fallback)) in stop_rules.iter_mut().enumerate() {
                    let verdict = match rule.stop_check(token.id, &piece) {
                        Ok(v) => v,
                        Err(e) if *fallback => {
                            tracing::warn!("stop rule dropped for this request: {e:#}");
                            faulted = Some(i);
                            break;
                        }
                        Err(e) => return Err(e),
                    };
                    if let Some(trim) = verdict {
                        held.push_str(&piece);
                        piece.clear();
                        let keep = held.chars().count().saturating_sub(trim);
                        held = held.chars().take(keep).collect();
                        finish = Some(Finish::StopRule(rule.plugin().name().to_string()));
                        break;
                    }
                }
                if let Some(i) = faulted {
                    stop_rules.remove(i);
                }
                held.push_str(&piece);
                let release = if finish.is_some() { held.len() } else { char_split(&held, hold) };
                let out = stop.push(&held[..release]);
                held.drain(..release);
                text = out.text;
                if let Some(s) = out.stopped {
                    finish = Some(Finish::StopString(s));
                }
            }
            if finish.is_none() {
                finish = match token.finish {
                    Some(FinishReason::Stop) => Some(Finish::Eos),
                    Some(FinishReason::Length) => Some(Finish::Length),
                    None => None,
                };
                if finish.is_some() && !matches!(finish, Some(Finish::StopString(_))) {
                    held.push_str(&detok.flush()?);
                    let tail = stop.push(&std::mem::take(&mut held));
                    text.push_str(&tail.text);
                    match tail.stopped {
                        Some(s) => finish = Some(Finish::StopString(s)),
                        None => text.push_str(&stop.flush()),
                    }
                }
            }
            if (!text.is_empty() || !logprobs.is_empty()) && job.events.send(Event::Delta { text, logprobs }).is_err() {
                break; // The client went away.
            }
            if finish.is_some() || job.events.is_closed() {
                break;
            }
        }
        for (rule, _, _) in stop_rules.iter_mut() {
            rule.end();
        }
        let stats = generation.stats();
        let speculative = (request.speculative.method != SpecMethod::Off).then_some(SpecUsage {
            method: request.speculative.method,
            drafted_tokens: stats.drafted_tokens,
            accepted_tokens: stats.accepted_tokens,
            target_steps: stats.decode_steps,
        });
        if let Some(s) = &speculative {
            self.stats.spec_drafted_tokens.fetch_add(s.drafted_tokens, Ordering::Relaxed);
            self.stats.spec_accepted_tokens.fetch_add(s.accepted_tokens, Ordering::Relaxed);
            self.stats.spec_target_steps.fetch_add(s.target_steps, Ordering::Relaxed);
            self.stats.spec_generated_tokens.fetch_add(stats.generated_tokens, Ordering::Relaxed);
        }
        let usage = Usage {
            prompt_tokens: prompt.len(),
            completion_tokens: generated.len(),
            cached_tokens: reused,
            speculative,
        };
        let _ = job.events.send(Event::Done { finish: finish.unwrap_or(Finish::Length), usage });
        // Keep the KV of everything the cache now holds for the next request.
        let mut cache = generation.into_cache();
        let held = cache.first().map_or(0, models::KvCache::offset);
        let mut sequence = prompt.clone();
        sequence.extend(&generated);
        if held <= sequence.len() {
            sequence.truncate(held);
            let state: Vec<&Array> = cache.iter().flat_map(models::KvCache::state).collect();
            mlx::eval(&state)?;
            self.cache.insert(sequence, std::mem::take(&mut cache));
        }
        Ok(())
    }

    /// Starts the request's plugin instances: the sampler (fed the whole prompt) and the
    /// stop rules with how many characters each needs held back.
    #[allow(clippy::type_complexity)]
    fn start_plugins(
        &self,
        selection: &Selection,
        prompt: &[u32],
        seed: u64,
    ) -> Result<(Option<Box<dyn super::ExternalSampler>>, Vec<(Instance, usize, bool)>)> {
        if selection.is_empty() {
            return Ok((None, Vec::new()));
        }
        let registry = self.plugins.as_ref().context("this server has no plugin runtime")?;
        // A plugin that faults while starting is skipped when the request allows a fallback
        // (a refused config is still the client's error).
        let skip = |selected: &crate::plugins::Selected, e: &anyhow::Error| {
            let refused = e.chain().any(|c| c.downcast_ref::<PluginRefused>().is_some());
            if selected.fallback && !refused {
                tracing::warn!("plugin {} skipped for this request: {e:#}", selected.plugin.name());
                true
            } else {
                false
            }
        };
        let mut external: Option<Box<dyn super::ExternalSampler>> = None;
        if let Some(selected) = &selection.sampler {
            let started = registry.start(selected, seed).and_then(|mut instance| {
                instance.accept(prompt)?;
                Ok(instance)
            });
            match started {
                Ok(instance) => {
                    let sampler = PluginSampler::new(instance, self.info.vocab_size).with_fallback(selected.fallback);
                    external = Some(Box::new(sampler));
                }
                Err(e) if skip(selected, &e) => {}
                Err(e) => return Err(e),
            }
        }
        let mut stops = Vec::new();
        for selected in &selection.stops {
            match registry.start(selected, seed) {
                Ok(instance) => stops.push((instance, selected.plugin.manifest.stop().hold, selected.fallback)),
                Err(e) if skip(selected, &e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok((external, stops))
    }

    /// The chosen token's log-probability and the `k` most likely tokens.
    fn logprob(&self, logprobs: &Array, id: u32, k: usize) -> Result<TokenLogprob> {
        let all = logprobs.astype(mlx::Dtype::Float32)?;
        let chosen = all.take(&Array::from_i32(&[id as i32], &[1])?, 0)?.item_f32()?;
        let mut top = Vec::new();
        if k > 0 {
            let idx = all.negative()?.argpartition(k as i32 - 1, 0)?.slice_axis(0, 0, k as i32)?;
            let values = all.take(&idx, 0)?.to_vec_f32()?;
            let ids = idx.to_vec_i32()?;
            let mut pairs: Vec<(u32, f32)> = ids.into_iter().map(|i| i as u32).zip(values).collect();
            pairs.sort_by(|a, b| b.1.total_cmp(&a.1));
            for (t, lp) in pairs {
                top.push((self.tokenizer.decode(&[t])?, lp));
            }
        }
        Ok(TokenLogprob { token: self.tokenizer.decode(&[id])?, logprob: chosen, top })
    }
}
