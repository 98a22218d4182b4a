//! A request's text on its way out: token text through the stop strings and rules, the
//! tool-call and reasoning parsers, into `Event`s; and token log-probabilities.

use super::job::{Event, TokenLogprob};

use super::hooks::{TextParser, ToolOutput};
use anyhow::Result;
use mlx::Array;
use models::Tokenizer;

/// The byte index that leaves the last `keep` characters of `s` after it.
pub(super) fn char_split(s: &str, keep: usize) -> usize {
    if keep == 0 {
        return s.len();
    }
    s.char_indices().rev().nth(keep - 1).map_or(0, |(i, _)| i)
}

/// A tool adapter on a request's output, and how many calls it has reported.
pub(super) struct Tools {
    pub(super) adapter: Box<dyn TextParser<ToolOutput>>,
    pub(super) calls: usize,
}

/// Moves pending content into a `Delta` event.
pub(super) fn flush(events: &mut Vec<Event>, content: &mut String) {
    if !content.is_empty() {
        events.push(Event::Delta { text: std::mem::take(content), logprobs: vec![] });
    }
}

/// Turns a tool adapter's output into events (content gathers in `content`). `true` when a
/// second call arrives where one was asked for: the reply ends before it.
pub(super) fn route(
    tools: &mut Tools,
    out: Vec<ToolOutput>,
    one_call: bool,
    events: &mut Vec<Event>,
    content: &mut String,
) -> bool {
    for o in out {
        match o {
            ToolOutput::Content(c) => content.push_str(&c),
            ToolOutput::Call { .. } if one_call && tools.calls > 0 => return true,
            ToolOutput::Call { index, id, name } => {
                flush(events, content);
                tools.calls += 1;
                events.push(Event::ToolCall { index, id, name });
            }
            ToolOutput::Args { index, delta } => events.push(Event::ToolArgs { index, delta }),
        }
    }
    false
}

/// The chosen token's log-probability and the `k` most likely tokens.
pub(super) fn logprob(tokenizer: &Tokenizer, logprobs: &Array, id: u32, k: usize) -> Result<TokenLogprob> {
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
            top.push((tokenizer.decode(&[t])?, lp));
        }
    }
    Ok(TokenLogprob { token: tokenizer.decode(&[id])?, logprob: chosen, top })
}
