//! The engine's scheduling: a [`Policy`] decides from a [`QueueView`] (the scheduler
//! plugin's JSON, ABI.md §5.4) which waiting request runs next, which running one to pause
//! and which waiting ones to cancel; [`plan`] turns its decision into what the worker does,
//! as a pure function over request tickets (the worker applies it). Without a policy the
//! queue is first come, first served.

use serde::{Deserialize, Serialize};

/// One request as a policy sees it.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub id: String,
    pub priority: i64,
    pub prompt_tokens: usize,
    pub waited_ms: u64,
    pub generated_tokens: usize,
    pub client: Option<String>,
    pub hints: serde_json::Value,
    /// Positions of KV the request holds now (running or paused; 0 for one not started).
    pub kv_tokens: usize,
    /// Bytes of that KV.
    pub kv_bytes: usize,
}

/// The engine's slots: how many requests may run at once, and how many are free.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Slots {
    pub max: usize,
    pub free: usize,
}

/// The memory budget, in KV positions (0: no budget set): the whole, and what the running
/// requests' reservations (prompt + max_tokens each) leave of it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Memory {
    pub kv_budget_tokens: usize,
    pub kv_free_tokens: usize,
}

/// What a policy is shown.
#[derive(Debug, Clone, Serialize)]
pub struct QueueView {
    pub now_ms: u64,
    pub running: Vec<Entry>,
    pub waiting: Vec<Entry>,
    pub slots: Slots,
    pub memory: Memory,
}

/// What a policy decides. Unknown ids are ignored; waiting ids missing from `order` keep
/// their relative order after the listed ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Decision {
    pub order: Vec<String>,
    pub preempt: Vec<String>,
    pub cancel: Vec<String>,
}

/// A scheduling policy (the scheduler plugin, in the server).
pub trait Policy {
    /// The policy's name, for logs and cancellation messages.
    fn name(&self) -> String;
    fn decide(&mut self, view: &QueueView) -> anyhow::Result<Decision>;
    /// Whether it chooses how many drafts the batch's speculative rows verify
    /// (`schedule_drafts`, ABI.md §5.4); if not, the built-in rule does.
    fn chooses_drafts(&mut self) -> bool {
        false
    }
    /// Each speculative row's draft budget for this step; `None`: the built-in rule's.
    fn drafts(&mut self, _view: &DraftView) -> anyhow::Result<Option<DraftDecision>> {
        Ok(None)
    }
}

/// What a policy is shown to choose a verification's draft budgets: the batch's speculative
/// rows, each with the tokens its drafter proposed this step, the chances that its first
/// 1, 2, ... drafts all pass (its recent verifications, position by position) and the
/// built-in rule's budget; the batch's rows in all; the measured milliseconds of a step by
/// the positions it feeds (rows × positions per row: verifications, and plain steps where no
/// verification of that size was timed); and of a plain step by its rows.
#[derive(Debug, Clone, Serialize)]
pub struct DraftView {
    pub rows: Vec<DraftRow>,
    pub batch_rows: usize,
    pub step_ms: std::collections::BTreeMap<usize, f64>,
    pub plain_step_ms: std::collections::BTreeMap<usize, f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DraftRow {
    pub id: String,
    pub drafted: usize,
    pub survival: Vec<f64>,
    pub rule: usize,
}

/// A policy's draft budgets: by row id, and for the rows it does not name (absent: the
/// built-in rule's). A budget above what a row drafted is that row's drafts; 0 everywhere
/// makes the step plain.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DraftDecision {
    pub drafts: std::collections::BTreeMap<String, usize>,
    pub default: Option<usize>,
}

/// Makes the engine's policy, once, on the engine thread (`EngineConfig::policy`).
#[derive(Clone)]
pub struct MakePolicy(pub std::sync::Arc<dyn Fn() -> Box<dyn Policy> + Send + Sync>);

impl std::fmt::Debug for MakePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MakePolicy")
    }
}

/// The positions of `ids` in the order `decision` gives: listed ids first, in its order,
/// then the rest in their current order. Cancelled ids are left out.
pub fn reorder(ids: &[String], decision: &Decision) -> Vec<usize> {
    let mut out = Vec::with_capacity(ids.len());
    for wanted in &decision.order {
        if let Some(i) = ids.iter().position(|id| id == wanted) {
            if !out.contains(&i) && !decision.cancel.contains(wanted) {
                out.push(i);
            }
        }
    }
    for (i, id) in ids.iter().enumerate() {
        if !out.contains(&i) && !decision.cancel.contains(id) {
            out.push(i);
        }
    }
    out
}

/// Paused requests that keep their KV at most (beyond them, a preempted request's KV is
/// dropped and recomputed when it resumes).
pub const MAX_PAUSED: usize = 4;

/// A waiting request, as the plan sees it: its id, the KV positions it reserves (prompt +
/// max_tokens) and where it stands.
#[derive(Debug, Clone)]
pub struct Waiter {
    pub id: String,
    pub kv_reserved: usize,
    pub state: WaitState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitState {
    /// Not started.
    New,
    /// Paused with its KV kept.
    Parked,
    /// Paused with its KV dropped (recomputed when it resumes).
    Dropped,
}

/// A running request: its id, reservation, and whether its KV can be dropped (a batch row
/// or a prefill can; a request decoding alone for speculation or tensor parallelism keeps
/// state that cannot be recomputed, so it can only be parked).
#[derive(Debug, Clone)]
pub struct Runner {
    pub id: String,
    pub kv_reserved: usize,
    pub droppable: bool,
}

/// What the engine has room for: batch rows, and the KV budget in positions (0: none set).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_batch: usize,
    pub kv_budget_tokens: usize,
}

/// What happens to the running request a policy asked to preempt (an index into `running`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    /// Paused with its KV kept: the paused ones, the running ones and the next could all
    /// reach their maximum length within the budget, and fewer than [`MAX_PAUSED`] wait so.
    Park(usize),
    /// Paused with its KV dropped (`short`: because memory is short, else because
    /// [`MAX_PAUSED`] already wait with theirs).
    Drop { index: usize, short: bool },
    /// Neither: it cannot be dropped and cannot be kept, so it runs on.
    Refused { index: usize, short: bool },
}

/// The worker's orders from one decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Waiting requests to cancel (indices into `waiting`).
    pub cancel: Vec<usize>,
    /// The rest of `waiting`, in the order they wait from now on.
    pub order: Vec<usize>,
    /// A preemption, only when the first of `order` has no room: every row taken, or no
    /// memory for it beside the running requests. The preempted request waits second.
    pub preempt: Option<Preemption>,
    /// The KV positions the running, parked and next requests hold together (for logs).
    pub held_tokens: usize,
}

/// The plan for `decision` over `waiting` and `running`.
pub fn plan(waiting: &[Waiter], running: &[Runner], decision: &Decision, limits: Limits) -> Plan {
    let ids: Vec<String> = waiting.iter().map(|w| w.id.clone()).collect();
    let cancel: Vec<usize> = (0..waiting.len()).filter(|&i| decision.cancel.contains(&ids[i])).collect();
    let order = reorder(&ids, decision);
    let budget = limits.kv_budget_tokens;
    let reserved: usize = running.iter().map(|r| r.kv_reserved).sum();
    let first = order.first().map(|&i| &waiting[i]);
    let parked: Vec<&Waiter> = order.iter().map(|&i| &waiting[i]).filter(|w| w.state == WaitState::Parked).collect();
    let held_tokens = reserved
        + parked.iter().map(|w| w.kv_reserved).sum::<usize>()
        + first.filter(|w| w.state == WaitState::New).map_or(0, |w| w.kv_reserved);
    let no_room =
        running.len() >= limits.max_batch || first.is_some_and(|w| budget > 0 && reserved + w.kv_reserved > budget);
    let asked = running.iter().position(|r| decision.preempt.contains(&r.id));
    let preempt = asked.filter(|_| no_room && first.is_some()).map(|index| {
        let short = budget > 0 && held_tokens > budget;
        let keep = !short && parked.len() < MAX_PAUSED;
        match (keep, running[index].droppable) {
            (true, _) => Preemption::Park(index),
            (false, true) => Preemption::Drop { index, short },
            (false, false) => Preemption::Refused { index, short },
        }
    });
    Plan { cancel, order, preempt, held_tokens }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_first_then_the_rest_in_order_and_unknown_ignored() {
        let ids: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let d = Decision {
            order: vec!["c".into(), "zz".into(), "a".into(), "c".into()],
            preempt: vec![],
            cancel: vec!["b".into()],
        };
        assert_eq!(reorder(&ids, &d), vec![2, 0, 3]);
        assert_eq!(reorder(&ids, &Decision::default()), vec![0, 1, 2, 3]);
    }

    fn waiter(id: &str, kv: usize, state: WaitState) -> Waiter {
        Waiter { id: id.into(), kv_reserved: kv, state }
    }

    fn runner(id: &str, kv: usize, droppable: bool) -> Runner {
        Runner { id: id.into(), kv_reserved: kv, droppable }
    }

    fn decide(order: &[&str], preempt: &[&str], cancel: &[&str]) -> Decision {
        let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        Decision { order: own(order), preempt: own(preempt), cancel: own(cancel) }
    }

    /// The scheduler's plan, case by case: when a preempted request is parked, dropped or
    /// left running (rows full or memory short, the paused cap, a request that decodes alone
    /// and cannot be dropped), and how a policy's cancels and order apply.
    #[test]
    fn the_plan_for_each_kind_of_decision() {
        use Preemption::*;
        use WaitState::*;
        let parked = |n: usize| (0..n).map(|i| waiter(&format!("p{i}"), 10, Parked)).collect::<Vec<_>>();
        struct Case {
            what: &'static str,
            waiting: Vec<Waiter>,
            running: Vec<Runner>,
            decision: Decision,
            limits: Limits,
            cancel: Vec<usize>,
            order: Vec<usize>,
            preempt: Option<Preemption>,
        }
        let full = Limits { max_batch: 1, kv_budget_tokens: 0 };
        let roomy = Limits { max_batch: 4, kv_budget_tokens: 0 };
        let cases = vec![
            Case {
                what: "no preemption asked: cancels leave, the order applies, the rest keep theirs",
                waiting: vec![waiter("a", 10, New), waiter("b", 10, New), waiter("c", 10, New), waiter("d", 10, New)],
                running: vec![runner("r", 10, true)],
                decision: decide(&["c"], &[], &["b"]),
                limits: full,
                cancel: vec![1],
                order: vec![2, 0, 3],
                preempt: None,
            },
            Case {
                what: "preemption asked while a row is free: nothing to make room for",
                waiting: vec![waiter("a", 10, New)],
                running: vec![runner("r", 10, true)],
                decision: decide(&[], &["r"], &[]),
                limits: roomy,
                cancel: vec![],
                order: vec![0],
                preempt: None,
            },
            Case {
                what: "rows full, no budget set, nobody paused: parked with its KV",
                waiting: vec![waiter("a", 10, New)],
                running: vec![runner("r", 10, true)],
                decision: decide(&[], &["r"], &[]),
                limits: full,
                cancel: vec![],
                order: vec![0],
                preempt: Some(Park(0)),
            },
            Case {
                what: "the paused cap reached: dropped, not for memory",
                waiting: [vec![waiter("a", 10, New)], parked(MAX_PAUSED)].concat(),
                running: vec![runner("r", 10, true)],
                decision: decide(&[], &["r"], &[]),
                limits: full,
                cancel: vec![],
                order: (0..=MAX_PAUSED).collect(),
                preempt: Some(Drop { index: 0, short: false }),
            },
            Case {
                what: "a paused request whose KV was dropped does not count against the cap",
                waiting: [vec![waiter("a", 10, New)], parked(MAX_PAUSED - 1), vec![waiter("x", 10, Dropped)]].concat(),
                running: vec![runner("r", 10, true)],
                decision: decide(&[], &["r"], &[]),
                limits: full,
                cancel: vec![],
                order: (0..=MAX_PAUSED).collect(),
                preempt: Some(Park(0)),
            },
            Case {
                what: "rows free but the next does not fit the budget, and all together would not: dropped for memory",
                waiting: vec![waiter("a", 60, New)],
                running: vec![runner("r", 50, true), runner("s", 10, true)],
                decision: decide(&[], &["s"], &[]),
                limits: Limits { max_batch: 8, kv_budget_tokens: 100 },
                cancel: vec![],
                order: vec![0],
                preempt: Some(Drop { index: 1, short: true }),
            },
            Case {
                what: "memory short and the request decodes alone (cannot be dropped): it runs on",
                waiting: vec![waiter("a", 60, New)],
                running: vec![runner("r", 50, false)],
                decision: decide(&[], &["r"], &[]),
                limits: Limits { max_batch: 1, kv_budget_tokens: 100 },
                cancel: vec![],
                order: vec![0],
                preempt: Some(Refused { index: 0, short: true }),
            },
            Case {
                what: "one decoding alone is parked when everything fits",
                waiting: vec![waiter("a", 40, New)],
                running: vec![runner("r", 50, false)],
                decision: decide(&[], &["r"], &[]),
                limits: Limits { max_batch: 1, kv_budget_tokens: 100 },
                cancel: vec![],
                order: vec![0],
                preempt: Some(Park(0)),
            },
            Case {
                what: "alone, at the paused cap, memory not short: it runs on",
                waiting: [vec![waiter("a", 10, New)], parked(MAX_PAUSED)].concat(),
                running: vec![runner("r", 10, false)],
                decision: decide(&[], &["r"], &[]),
                limits: full,
                cancel: vec![],
                order: (0..=MAX_PAUSED).collect(),
                preempt: Some(Refused { index: 0, short: false }),
            },
            Case {
                what: "the only waiting request cancelled: no one to preempt for",
                waiting: vec![waiter("a", 10, New)],
                running: vec![runner("r", 10, true)],
                decision: decide(&[], &["r"], &["a"]),
                limits: full,
                cancel: vec![0],
                order: vec![],
                preempt: None,
            },
            Case {
                what: "an unknown id to preempt is ignored",
                waiting: vec![waiter("a", 10, New)],
                running: vec![runner("r", 10, true)],
                decision: decide(&[], &["zz"], &[]),
                limits: full,
                cancel: vec![],
                order: vec![0],
                preempt: None,
            },
            Case {
                what: "the policy's first choice is what room is made for: a parked one first counts once",
                waiting: vec![waiter("a", 10, New), waiter("p", 45, Parked)],
                running: vec![runner("r", 50, true)],
                decision: decide(&["p"], &["r"], &[]),
                limits: Limits { max_batch: 1, kv_budget_tokens: 100 },
                cancel: vec![],
                order: vec![1, 0],
                preempt: Some(Park(0)),
            },
        ];
        for c in cases {
            let got = plan(&c.waiting, &c.running, &c.decision, c.limits);
            assert_eq!((got.cancel, got.order, got.preempt), (c.cancel, c.order, c.preempt), "{}", c.what);
        }
    }
}
