//! The worker's side of scheduling: shows the policy the queue, applies the plan
//! (`scheduler::plan`) it turns into — cancels, the new order, and a preemption, which
//! parks a running request with its KV or drops its KV into the prompt cache.

use super::*;
use crate::engine::scheduler::{self, Entry, Limits, Memory, Preemption, QueueView, Runner, Slots, WaitState, Waiter};

/// The waiting requests as the scheduler's plan sees them (`state`: the positions a
/// sequence's recurrent state counts as).
fn waiters(waiting: &[Waiting<'_>], state: usize) -> Vec<Waiter> {
    waiting
        .iter()
        .map(|w| Waiter {
            id: w.job().key(),
            kv_reserved: kv_reserved(w.job(), state),
            state: match w {
                Waiting::New(_) => WaitState::New,
                Waiting::Paused(a) if a.holds_kv() => WaitState::Parked,
                Waiting::Paused(_) => WaitState::Dropped,
            },
        })
        .collect()
}

/// The running requests as the scheduler's plan sees them: a batch row or a prefill can
/// have its KV dropped; one decoding alone only if it can go on as a batch row (a lone
/// constrained request), since speculation's or tensor parallelism's state cannot be
/// recomputed.
fn runners(running: &[Active<'_>], batch: &Batch<'_>, state: usize) -> Vec<Runner> {
    running
        .iter()
        .map(|a| Runner {
            id: a.job.key(),
            kv_reserved: kv_reserved(&a.job, state),
            droppable: match &a.source {
                Source::Batched | Source::Prefill { .. } => true,
                Source::Solo(g) => g.can_hand_over() && batch.batches(),
                _ => false,
            },
        })
        .collect()
}

impl Worker {
    /// Asks the policy about the queue and applies its decision: cancel, reorder, and, when
    /// every slot is taken, pause a running request the policy preempts in favour of the
    /// first waiting one (a batch row leaves the batch with its KV).
    pub(super) fn schedule<'m>(
        &mut self,
        waiting: &mut Vec<Waiting<'m>>,
        running: &mut Vec<Active<'m>>,
        batch: &mut Batch<'m>,
    ) {
        let view = self.queue_view(waiting, running);
        let Some(policy) = self.policy.as_mut() else { return };
        let decision = match policy.decide(&view) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("scheduling policy failed, serving first come first served: {e:#}");
                return;
            }
        };
        let name = policy.name();
        let budget = view.memory.kv_budget_tokens;
        let limits = Limits { max_batch: self.max_batch, kv_budget_tokens: budget };
        let state = self.state_positions();
        let plan = scheduler::plan(&waiters(waiting, state), &runners(running, batch, state), &decision, limits);
        let mut slots: Vec<Option<Waiting<'m>>> = waiting.drain(..).map(Some).collect();
        for &i in &plan.cancel {
            let message = format!(
                "the {name} scheduling policy cancelled this request (for example, a newer request from the same client superseded it)"
            );
            let cancel = Event::Cancelled(Cancel { message, shutdown: false });
            match slots[i].take() {
                Some(Waiting::New(job)) => {
                    self.stats.queue_depth.fetch_sub(1, Ordering::SeqCst);
                    let _ = job.events.send(cancel);
                }
                Some(Waiting::Paused(a)) => {
                    let _ = a.job.events.send(cancel);
                }
                None => {}
            }
        }
        waiting.extend(plan.order.iter().filter_map(|&i| slots[i].take()));
        if let Some(preemption) = plan.preempt {
            self.preempt(preemption, &name, plan.held_tokens, waiting, running, batch);
        }
    }

    /// What the policy is shown: the running and waiting requests, the rows and the memory.
    fn queue_view(&self, waiting: &[Waiting<'_>], running: &[Active<'_>]) -> QueueView {
        let per_token = self.info.kv_bytes_per_token;
        let entry = |job: &Job, generated: usize, kv_tokens: usize| Entry {
            id: job.key(),
            priority: job.request.priority,
            prompt_tokens: job.request.prompt.len(),
            waited_ms: job.arrived.elapsed().as_millis() as u64,
            generated_tokens: generated,
            client: job.request.client.clone(),
            hints: serde_json::Value::Object(Default::default()),
            kv_tokens,
            kv_bytes: kv_tokens * per_token,
        };
        let budget = self.kv_budget_tokens.load(Ordering::Relaxed);
        let state = self.state_positions();
        let reserved: usize = running.iter().map(|a| kv_reserved(&a.job, state)).sum();
        QueueView {
            now_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            running: running.iter().map(|a| entry(&a.job, a.generated.len(), a.kv_tokens())).collect(),
            waiting: waiting
                .iter()
                .map(|w| match w {
                    Waiting::New(job) => entry(job, 0, 0),
                    Waiting::Paused(a) => entry(&a.job, a.generated.len(), a.kv_tokens()),
                })
                .collect(),
            slots: Slots { max: self.max_batch, free: self.max_batch.saturating_sub(running.len()) },
            memory: Memory { kv_budget_tokens: budget, kv_free_tokens: budget.saturating_sub(reserved) },
        }
    }

    /// Carries out the plan's preemption: the running request parked or dropped, and then
    /// waiting second (after the one it made room for), or left running, and why, logged.
    fn preempt<'m>(
        &mut self,
        preemption: Preemption,
        policy: &str,
        reserved_tokens: usize,
        waiting: &mut Vec<Waiting<'m>>,
        running: &mut Vec<Active<'m>>,
        batch: &mut Batch<'m>,
    ) {
        let budget = self.kv_budget_tokens.load(Ordering::Relaxed);
        let (index, keep, short) = match preemption {
            Preemption::Refused { index, short } => {
                let key = Some(running[index].job.key());
                if short && self.not_paused != key {
                    tracing::info!(
                        request = running[index].job.key(),
                        policy,
                        reserved_tokens,
                        budget_tokens = budget,
                        "not paused: it decodes alone (its state cannot be recomputed), and the paused, running and next requests together could outgrow the memory budget"
                    );
                }
                self.not_paused = key;
                return;
            }
            Preemption::Park(index) => (index, true, false),
            Preemption::Drop { index, short } => (index, false, short),
        };
        let mut active = running.remove(index);
        let outcome = if keep { self.park(&mut active, batch) } else { self.drop_kv(&mut active, batch) };
        if let Err(e) = outcome {
            let _ = active.job.events.send(failure(e));
            return;
        }
        if keep {
            tracing::info!(request = active.job.key(), policy, "paused for a waiting request");
        } else {
            let why = if short { "memory is short" } else { "the most requests that wait with their KV already do" };
            tracing::info!(
                request = active.job.key(),
                policy,
                reserved_tokens,
                budget_tokens = budget,
                "dropped for a waiting request ({why}): its KV went to the prompt cache and is recomputed when it resumes"
            );
        }
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        waiting.insert(1, Waiting::Paused(Box::new(active)));
    }

    /// Pauses a preempted request with its KV: a batch row leaves the batch with its cache.
    fn park<'m>(&mut self, active: &mut Active<'m>, batch: &mut Batch<'m>) -> Result<()> {
        if matches!(active.source, Source::Batched) {
            if let Some(left) = batch.leave(active.job.seq)? {
                active.source = Source::Parked(Box::new(left));
            }
        }
        Ok(())
    }

    /// Preempts a batch row or a prefilling request by dropping its KV: the cache goes to the
    /// prompt cache under the tokens it holds, and the request keeps the sequence to recompute.
    fn drop_kv<'m>(&mut self, active: &mut Active<'m>, batch: &mut Batch<'m>) -> Result<()> {
        let (sequence, cache, then) = match std::mem::replace(&mut active.source, Source::Batched) {
            Source::Batched => {
                let left = batch.leave(active.job.seq)?.context("a running row was not in the batch")?;
                let mut sequence = active.job.request.prompt.clone();
                sequence.extend(&active.generated);
                (sequence, left.cache, Then::Batch(Box::new(left.row)))
            }
            Source::Prefill { cache, then, .. } => (active.job.request.prompt.clone(), cache, then),
            Source::Solo(generation) if generation.can_hand_over() && batch.batches() => {
                let handover = generation.hand_over();
                self.stats.forced_tokens.fetch_add(handover.stats.forced_tokens, Ordering::Relaxed);
                let mut sequence = active.job.request.prompt.clone();
                sequence.extend(&active.generated);
                let row = Row::new(active.job.seq, &sequence, handover.sampler, handover.options)?;
                (sequence, handover.cache, Then::Batch(Box::new(row.with_constraint(handover.constraint))))
            }
            other => {
                active.source = other;
                bail!("only a batch row, a prefilling request or a lone constrained one can be dropped")
            }
        };
        // The cache holds the sequence but its last token (or, prefilling, a prefix of it).
        let held = cache.first().map_or(0, models::KvCache::offset);
        if held >= sequence.len() {
            bail!("a preempted request's cache holds {held} positions for a sequence of {}", sequence.len());
        }
        self.keep_cache(&sequence, cache)?;
        active.source = Source::Dropped { sequence, then };
        self.stats.prompt_cache_bytes.store(self.cache.bytes(), Ordering::Relaxed);
        Ok(())
    }
}
