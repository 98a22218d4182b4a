//! Built-in reasoning parser: the model's thinking between two markers (`<think>` and
//! `</think>` by default: Qwen3, DeepSeek-R1, QwQ; `{"open": "[THINK]", "close":
//! "[/THINK]"}` for Magistral) goes out as reasoning, the rest as content.
//!
//! Thinking is recognized only at the start of the reply (after any whitespace), or from the
//! very first token when the prompt already opened it (`prompt_tail` ends with the open
//! marker, as Qwen3-Thinking's and DeepSeek-R1's templates do). The whitespace models put
//! around the markers (`<think>\n...\n</think>\n\n`) is dropped at both edges.

use plugin_sdk::{ReasoningEvent, ReasoningParser};
use plugin_util::{partial_suffix, push_reasoning as push};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    open: String,
    close: String,
}

impl Default for Config {
    fn default() -> Self {
        Config { open: "<think>".into(), close: "</think>".into() }
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Params {
    prompt_tail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Mode {
    /// Nothing but whitespace yet: the reply may still open with the marker.
    #[default]
    Start,
    Reasoning,
    Content,
}

#[derive(Default)]
pub struct Think {
    config: Config,
    mode: Mode,
    /// Text held back: whitespace that may border a marker, or a marker's possible start.
    held: String,
    /// Drop whitespace until the next other character (right after a marker).
    skip_space: bool,
}

impl Think {
    /// Moves what is certain from `held` to `out`; `last` at the end of output.
    fn drain(&mut self, out: &mut Vec<ReasoningEvent>, last: bool) {
        loop {
            if self.skip_space {
                let rest = self.held.trim_start().len();
                self.held.drain(..self.held.len() - rest);
                if self.held.is_empty() {
                    return;
                }
                self.skip_space = false;
            }
            match self.mode {
                Mode::Start => {
                    let body = self.held.trim_start();
                    if let Some(after) = body.strip_prefix(self.config.open.as_str()) {
                        self.held = after.to_string();
                        (self.mode, self.skip_space) = (Mode::Reasoning, true);
                    } else if !last && (body.is_empty() || self.config.open.starts_with(body)) {
                        return;
                    } else {
                        self.mode = Mode::Content;
                    }
                }
                Mode::Reasoning => {
                    if let Some(i) = self.held.find(self.config.close.as_str()) {
                        push(out, true, self.held[..i].trim_end());
                        self.held.drain(..i + self.config.close.len());
                        (self.mode, self.skip_space) = (Mode::Content, true);
                        continue;
                    }
                    // Hold a possible start of the close marker and the whitespace before it.
                    let keep = if last { 0 } else { partial_suffix(&self.held, &self.config.close) };
                    let sure = self.held[..self.held.len() - keep].trim_end().len();
                    push(out, true, &self.held[..sure]);
                    self.held.drain(..sure);
                    if last {
                        self.held.clear();
                    }
                    return;
                }
                Mode::Content => {
                    push(out, false, &self.held);
                    self.held.clear();
                    return;
                }
            }
        }
    }
}

impl ReasoningParser for Think {
    fn init(&mut self, config: &str) -> Result<(), String> {
        self.config = plugin_util::parse("think", "config", config)?;
        if self.config.open.is_empty() || self.config.close.is_empty() {
            return Err("think: `open` and `close` must be non-empty markers".into());
        }
        Ok(())
    }

    fn begin(&mut self, params: &str, _seed: u64) -> Result<(), String> {
        let params: Params = plugin_util::parse("think", "params", params)?;
        if params.prompt_tail.trim_end().ends_with(self.config.open.as_str()) {
            (self.mode, self.skip_space) = (Mode::Reasoning, true);
        }
        Ok(())
    }

    fn feed(&mut self, text: &str, out: &mut Vec<ReasoningEvent>) {
        self.held.push_str(text);
        self.drain(out, false);
    }

    fn finish(&mut self, out: &mut Vec<ReasoningEvent>) {
        self.drain(out, true);
    }
}

plugin_sdk::export_reasoning_parser!(
    Think,
    r#"{"abi": 1, "name": "think", "version": "0.1.0", "kinds": ["reasoning"], "description": "reasoning between <think> and </think> (config: open, close markers)"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    /// A parser with `config`.
    fn parser(config: &str) -> impl Fn() -> Think + '_ {
        move || {
            let mut p = Think::default();
            p.init(config).unwrap();
            p
        }
    }

    fn every_split(config: &str, tail: &str, text: &str) -> (String, String) {
        plugin_util::split_reasoning_every_way(&parser(config), tail, text)
    }

    #[test]
    fn thinking_at_the_start_is_reasoning_and_the_rest_content() {
        let (r, c) = every_split("{}", "", "<think>\nThe user wants 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.");
        assert_eq!(r, "The user wants 2+2.\nIt is 4.");
        assert_eq!(c, "The answer is 4.");
    }

    #[test]
    fn a_reply_without_thinking_is_all_content() {
        assert_eq!(every_split("{}", "", "  Hello <think> there"), (String::new(), "  Hello <think> there".into()));
        assert_eq!(every_split("{}", "", "<thin"), (String::new(), "<thin".into()));
        assert_eq!(every_split("{}", "", "<thinking>x"), (String::new(), "<thinking>x".into()));
    }

    #[test]
    fn a_prompt_that_opens_the_thinking_starts_the_reply_inside_it() {
        let tail = "<|im_start|>assistant\n<think>\n";
        assert_eq!(every_split("{}", tail, "Hmm.</think>Yes."), ("Hmm.".into(), "Yes.".into()));
        // Thinking switched off by the template (an empty block closed in the prompt).
        let closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
        assert_eq!(every_split("{}", closed, "Yes."), (String::new(), "Yes.".into()));
    }

    #[test]
    fn thinking_cut_short_by_the_token_limit_stays_reasoning() {
        assert_eq!(every_split("{}", "", "<think>Let me see </"), ("Let me see </".into(), String::new()));
        assert_eq!(every_split("{}", "", "<think>\n"), (String::new(), String::new()));
    }

    #[test]
    fn markers_come_from_the_config() {
        let config = r#"{"open": "[THINK]", "close": "[/THINK]"}"#;
        assert_eq!(every_split(config, "", "[THINK]plan[/THINK]done"), ("plan".into(), "done".into()));
        let mut p = Think::default();
        assert!(p.init(r#"{"open": ""}"#).unwrap_err().contains("non-empty"));
        assert!(p.init(r#"{"opn": "x"}"#).unwrap_err().contains("think: bad config"));
    }

    #[test]
    fn events_are_the_abi_json_lines() {
        assert_eq!(ReasoningEvent::Reasoning("a\"b".into()).to_json(), r#"{"reasoning":"a\"b"}"#);
        assert_eq!(ReasoningEvent::Content("c".into()).to_json(), r#"{"content":"c"}"#);
    }
}
