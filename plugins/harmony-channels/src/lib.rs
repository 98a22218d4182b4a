//! Built-in reasoning parser for OpenAI's harmony format (GPT-OSS). The reply is a run of
//! messages, `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`,
//! each a header (channel, optional recipient `to=...`, optional `<|constrain|>` type) then a
//! body ending at `<|end|>`, `<|call|>`, `<|return|>` or the end of the output.
//!
//! - `analysis` bodies go out as reasoning; `final` and `commentary` (preambles) bodies as
//!   content, headers and end markers taken off.
//! - A message with a recipient (a tool call) goes on as written, header included, ended by
//!   `<|call|>`, for the `harmony` tool adapter to read.
//! - Where the prompt already opened a message (a forced call's opener ends the prompt with a
//!   header), the reply starts in that message; the part of the header the prompt wrote is not
//!   repeated (the host hands the opener to the tool adapter itself).
//! - Output that does not begin like a harmony header is passed through as content.

use plugin_sdk::{ReasoningEvent, ReasoningParser};
use plugin_util::{partial_suffix, push_reasoning as push};
use serde::Deserialize;

const MESSAGE: &str = "<|message|>";
const ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"];
/// Headers longer than this are not harmony: the text so far goes out as content.
const MAX_HEADER: usize = 512;

#[derive(Deserialize, Default)]
#[serde(default)]
struct Params {
    prompt_tail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    /// A message to a recipient: passed through as written.
    Call,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// In a header; `prompt` is the part of it the prompt wrote.
    Header {
        prompt: String,
    },
    Body(Body),
    /// Not harmony: everything is content.
    Plain,
}

impl Default for State {
    fn default() -> Self {
        State::Header { prompt: String::new() }
    }
}

#[derive(Default)]
pub struct Channels {
    state: State,
    /// Output text not yet classified.
    held: String,
}

/// What a complete header says the body is.
fn classify(header: &str) -> Body {
    if header.contains("to=") {
        Body::Call
    } else if header.split("<|channel|>").nth(1).is_some_and(|c| c.trim_start().starts_with("analysis")) {
        Body::Reasoning
    } else {
        Body::Content
    }
}

/// Whether `header` (possibly unfinished) can still be a harmony message header.
fn plausible(header: &str) -> bool {
    let h = header.trim_start();
    let h = h.strip_prefix("<|start|>").unwrap_or(h);
    let h = h.strip_prefix("assistant").unwrap_or(h).trim_start();
    h.is_empty()
        || ["<|start|>", "assistant", "<|channel|>", "to=", "<|constrain|>", MESSAGE]
            .iter()
            .any(|m| h.starts_with(m) || m.starts_with(h))
}

impl Channels {
    /// Moves what is certain from `held` to `out`; `last` at the end of output.
    fn drain(&mut self, out: &mut Vec<ReasoningEvent>, last: bool) {
        loop {
            match &self.state {
                State::Plain => {
                    push(out, false, &std::mem::take(&mut self.held));
                    return;
                }
                State::Header { prompt } => {
                    if let Some(i) = self.held.find(MESSAGE) {
                        let body = classify(&format!("{prompt}{}", &self.held[..i]));
                        let header: String = self.held.drain(..i + MESSAGE.len()).collect();
                        if body == Body::Call {
                            push(out, false, &header);
                        }
                        self.state = State::Body(body);
                        continue;
                    }
                    let whole = format!("{prompt}{}", self.held);
                    if !plausible(&whole) || whole.len() > MAX_HEADER {
                        self.state = State::Plain;
                        continue;
                    }
                    if last {
                        // A header cut off by the token limit says nothing.
                        self.held.clear();
                    }
                    return;
                }
                State::Body(body) => {
                    let body = *body;
                    let end = ENDS.iter().filter_map(|m| self.held.find(m).map(|at| (at, *m))).min();
                    if let Some((at, marker)) = end {
                        push(out, body == Body::Reasoning, &self.held[..at]);
                        if body == Body::Call {
                            push(out, false, "<|call|>");
                        }
                        // `<|start|>` opens the next message's header; the others end this one.
                        let skip = if marker == "<|start|>" { at } else { at + marker.len() };
                        self.held.drain(..skip);
                        self.state = State::default();
                        continue;
                    }
                    let keep =
                        if last { 0 } else { ENDS.iter().map(|m| partial_suffix(&self.held, m)).max().unwrap_or(0) };
                    let sure = self.held.len() - keep;
                    push(out, body == Body::Reasoning, &self.held[..sure]);
                    self.held.drain(..sure);
                    if last && body == Body::Call {
                        push(out, false, "<|call|>");
                    }
                    return;
                }
            }
        }
    }
}

impl ReasoningParser for Channels {
    fn begin(&mut self, params: &str, _seed: u64) -> Result<(), String> {
        let params: Params = plugin_util::parse("harmony-channels", "params", params)?;
        // The message the prompt leaves open: everything after its last `<|start|>`.
        let Some(at) = params.prompt_tail.rfind("<|start|>") else { return Ok(()) };
        let open = &params.prompt_tail[at..];
        if ENDS[..3].iter().any(|m| open.contains(m)) {
            return Ok(());
        }
        self.state = match open.split_once(MESSAGE) {
            Some((header, _)) => State::Body(classify(header)),
            None => State::Header { prompt: open.to_string() },
        };
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
    Channels,
    r#"{"abi": 1, "name": "harmony-channels", "version": "0.1.0", "kinds": ["reasoning"], "description": "OpenAI harmony channels (GPT-OSS): analysis as reasoning, final and preambles as content, tool-call messages on to the harmony tool adapter"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tail: &str, pieces: &[&str]) -> (String, String) {
        plugin_util::split_reasoning(&Channels::default, tail, pieces)
    }

    fn every_split(tail: &str, text: &str) -> (String, String) {
        plugin_util::split_reasoning_every_way(&Channels::default, tail, text)
    }

    const PROMPT: &str = "<|start|>user<|message|>Hi<|end|><|start|>assistant";

    #[test]
    fn analysis_is_reasoning_and_final_is_content() {
        let reply = "<|channel|>analysis<|message|>User greets. Reply.<|end|><|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>";
        assert_eq!(every_split(PROMPT, reply), ("User greets. Reply.".into(), "Hello! How can I help?".into()));
        // Cut by the token limit inside the analysis, or inside the next header.
        assert_eq!(
            every_split(PROMPT, "<|channel|>analysis<|message|>Thinking <|e"),
            ("Thinking <|e".into(), String::new())
        );
        assert_eq!(
            every_split(PROMPT, "<|channel|>analysis<|message|>T<|end|><|start|>assistant<|chan"),
            ("T".into(), String::new())
        );
    }

    #[test]
    fn a_call_goes_on_as_written_and_a_preamble_is_content() {
        let call = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";
        let reply = format!("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>{call}<|call|>");
        assert_eq!(every_split(PROMPT, &reply), ("Need weather.".into(), format!("Checking.{call}<|call|>")));
        // Without `<|call|>` (it is the stop token, so usually absent) the call still ends with it.
        let bare = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}";
        assert_eq!(every_split(PROMPT, bare), (String::new(), format!("{bare}<|call|>")));
    }

    #[test]
    fn a_forced_opener_in_the_prompt_starts_the_reply_inside_the_call() {
        let named = format!("{PROMPT}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>");
        assert_eq!(
            every_split(&named, "{\"city\": \"Paris\"}"),
            (String::new(), "{\"city\": \"Paris\"}<|call|>".into())
        );
        // Any function: the model writes the name and the rest of the header.
        let any = format!("{PROMPT}<|channel|>commentary to=functions.");
        let rest = "get_weather <|constrain|>json<|message|>{}";
        assert_eq!(every_split(&any, rest), (String::new(), format!("{rest}<|call|>")));
    }

    #[test]
    fn output_that_is_not_harmony_passes_through() {
        assert_eq!(every_split(PROMPT, "Hello <|channel|> there"), (String::new(), "Hello <|channel|> there".into()));
        assert_eq!(every_split("<|im_start|>assistant\n", "Plain text."), (String::new(), "Plain text.".into()));
        let long = format!("<|channel|>{}", "x".repeat(600));
        assert_eq!(run(PROMPT, &[&long]), (String::new(), long.clone()));
    }
}
