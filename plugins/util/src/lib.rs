//! Helpers shared by the built-in plugins (not part of the SDK, which depends on nothing).

use plugin_sdk::{Candidate, ReasoningEvent, ReasoningParser};
use serde::de::DeserializeOwned;

/// Parses a plugin's JSON config or params into `T` (missing fields take `T`'s defaults when
/// it has `#[serde(default)]`); the error names the plugin and what was wrong.
pub fn parse<T: DeserializeOwned>(plugin: &str, what: &str, json: &str) -> Result<T, String> {
    let json = if json.trim().is_empty() { "{}" } else { json };
    serde_json::from_str(json).map_err(|e| format!("{plugin}: bad {what}: {e}"))
}

/// Probabilities of `candidates` at `temperature` (> 0), in candidate order.
pub fn softmax(candidates: &[Candidate], temperature: f32) -> Vec<f64> {
    let t = f64::from(temperature.max(1e-6));
    let max = candidates.iter().map(|c| f64::from(c.logit)).fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = candidates.iter().map(|c| ((f64::from(c.logit) - max) / t).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.into_iter().map(|w| w / total).collect()
}

/// The index drawn from unnormalized `weights` with a uniform `u` in [0, 1).
pub fn pick(weights: &[f64], u: f64) -> usize {
    let total: f64 = weights.iter().sum();
    let mut left = u * total;
    for (i, w) in weights.iter().enumerate() {
        if left < *w {
            return i;
        }
        left -= w;
    }
    weights.iter().rposition(|w| *w > 0.0).unwrap_or(0)
}

/// Checks that `value` lies in `range`, with a message naming the plugin and field.
pub fn check(plugin: &str, field: &str, value: f32, ok: bool, want: &str) -> Result<(), String> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(format!("{plugin}: `{field}` must be {want}, got {value}"))
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `marker`: what a
/// streaming parser holds back while it may still become the marker.
pub fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// Appends `text` to `out` as reasoning or content, joined to the last event of that kind.
pub fn push_reasoning(out: &mut Vec<ReasoningEvent>, reasoning: bool, text: &str) {
    if text.is_empty() {
        return;
    }
    match (out.last_mut(), reasoning) {
        (Some(ReasoningEvent::Reasoning(r)), true) => r.push_str(text),
        (Some(ReasoningEvent::Content(c)), false) => c.push_str(text),
        _ => out.push(if reasoning {
            ReasoningEvent::Reasoning(text.into())
        } else {
            ReasoningEvent::Content(text.into())
        }),
    }
}

/// For reasoning parsers' tests: (reasoning, content) after feeding `pieces` to a parser
/// `new` makes, begun with `prompt_tail` `tail`.
pub fn split_reasoning<P: ReasoningParser>(new: &impl Fn() -> P, tail: &str, pieces: &[&str]) -> (String, String) {
    let mut p = new();
    p.begin(&serde_json::json!({ "prompt_tail": tail }).to_string(), 0).unwrap();
    let mut out = Vec::new();
    for piece in pieces {
        p.feed(piece, &mut out);
    }
    p.finish(&mut out);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in out {
        match e {
            ReasoningEvent::Reasoning(r) => reasoning.push_str(&r),
            ReasoningEvent::Content(c) => content.push_str(&c),
        }
    }
    (reasoning, content)
}

/// As `split_reasoning` on `text` whole, checking that every way of cutting it in two, and
/// in single characters, gives the same split.
pub fn split_reasoning_every_way<P: ReasoningParser>(new: &impl Fn() -> P, tail: &str, text: &str) -> (String, String) {
    let whole = split_reasoning(new, tail, &[text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(split_reasoning(new, tail, &refs), whole, "one character at a time");
    for (i, _) in text.char_indices() {
        assert_eq!(split_reasoning(new, tail, &[&text[..i], &text[i..]]), whole, "split at {i}");
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_and_pick() {
        let c = [Candidate { token: 1, logit: 2.0 }, Candidate { token: 2, logit: 0.0 }];
        let p = softmax(&c, 1.0);
        assert!((p[0] - 0.8808).abs() < 1e-4 && (p[0] + p[1] - 1.0).abs() < 1e-12);
        assert_eq!(pick(&p, 0.5), 0);
        assert_eq!(pick(&p, 0.95), 1);
        assert_eq!(pick(&[0.0, 1.0, 0.0], 0.999_999), 1);
    }

    #[test]
    fn parse_names_the_plugin() {
        #[derive(serde::Deserialize, Default, Debug)]
        #[serde(default, deny_unknown_fields)]
        struct C {
            tau: f32,
        }
        assert_eq!(parse::<C>("m", "config", "").unwrap().tau, 0.0);
        let e = parse::<C>("mirostat", "config", r#"{"tua": 1}"#).unwrap_err();
        assert!(e.starts_with("mirostat: bad config: unknown field `tua`"), "{e}");
    }
}
