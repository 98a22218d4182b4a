//! Test fixture: a scheduling policy written with the Rust SDK's `DraftScheduler` (the
//! optional `schedule_drafts` export, ABI.md §5.4). It leaves the queue as it is and verifies
//! one draft a step of each speculative row whose first draft is likely to pass (by the
//! row's recent verifications), whatever the host's own rule would have verified.

use plugin_sdk::{export_scheduler, DraftScheduler, Scheduler};
use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Deserialize)]
struct View {
    rows: Vec<DraftRow>,
}

#[derive(Deserialize)]
struct DraftRow {
    id: String,
    /// The chance that the row's first 1, 2, … drafts all pass.
    survival: Vec<f64>,
}

#[derive(Default)]
pub struct OneDraft;

impl Scheduler for OneDraft {
    fn schedule(&mut self, _queue: &str) -> String {
        "{}".into()
    }
}

impl DraftScheduler for OneDraft {
    fn schedule_drafts(&mut self, view: &str) -> String {
        let Ok(view) = serde_json::from_str::<View>(view) else { return "{}".into() };
        let likely = |r: &DraftRow| r.survival.first().is_some_and(|&p| p >= 0.25);
        let drafts: BTreeMap<String, usize> =
            view.rows.iter().map(|r| (r.id.clone(), usize::from(likely(r)))).collect();
        serde_json::json!({ "drafts": drafts }).to_string()
    }
}

export_scheduler!(OneDraft, r#"{"abi": 1, "name": "one-draft", "version": "0.1.0", "kinds": ["scheduler"]}"#, drafts);
