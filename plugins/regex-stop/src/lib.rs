//! Regex stop rule: ends generation where a regular expression first matches the output,
//! and trims the match and what follows it (or keeps the match with `"keep_match": true`).
//! Config: `{"pattern": "\\n\\n", "keep_match": false, "window": 2048}`; the pattern is
//! searched in the last `window` characters of the output (regex-lite syntax, i.e. Rust's
//! `regex` without Unicode classes). Up to 256 characters are held back so a match can be
//! trimmed before it reaches a streaming client; a longer trim is clamped to what is held.

use plugin_sdk::StopRule;
use plugin_util::parse;
use regex_lite::Regex;
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct Config {
    pattern: String,
    keep_match: bool,
    window: Option<usize>,
}

#[derive(Default)]
pub struct RegexStop {
    regex: Option<Regex>,
    keep_match: bool,
    window: usize,
    text: String,
}

impl StopRule for RegexStop {
    fn init(&mut self, config: &str) -> Result<(), String> {
        let c: Config = parse("regex-stop", "config", config)?;
        if c.pattern.is_empty() {
            return Err("regex-stop: config needs a non-empty `pattern`".into());
        }
        let regex = Regex::new(&c.pattern).map_err(|e| format!("regex-stop: bad `pattern`: {e}"))?;
        if regex.is_match("") {
            return Err(format!(
                "regex-stop: `pattern` {:?} matches the empty string, so it would stop at once",
                c.pattern
            ));
        }
        *self = RegexStop {
            regex: Some(regex),
            keep_match: c.keep_match,
            window: c.window.unwrap_or(2048).max(1),
            text: String::new(),
        };
        Ok(())
    }

    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        self.text.clear();
        Ok(())
    }

    fn check(&mut self, _token: u32, text: &str) -> Option<usize> {
        self.text.push_str(text);
        let regex = self.regex.as_ref()?;
        let chars = self.text.chars().count();
        let start = self.text.char_indices().nth(chars.saturating_sub(self.window)).map_or(0, |(i, _)| i);
        let m = regex.find(&self.text[start..])?;
        let cut = start + if self.keep_match { m.end() } else { m.start() };
        Some(self.text[cut..].chars().count())
    }
}

plugin_sdk::export_stop_rule!(
    RegexStop,
    r#"{"abi": 1, "name": "regex-stop", "version": "0.1.0", "kinds": ["stop"], "stop": {"hold": 256}, "description": "stops where a regular expression matches the output"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_at_the_match_and_trims_it() {
        let mut r = RegexStop::default();
        r.init(r#"{"pattern": "[0-9]+\\."}"#).unwrap();
        assert_eq!(r.check(0, "Step "), None);
        assert_eq!(r.check(0, "12"), None);
        assert_eq!(r.check(0, ". Go"), Some("12. Go".chars().count()));
        let mut keep = RegexStop::default();
        keep.init(r#"{"pattern": "é+", "keep_match": true}"#).unwrap();
        assert_eq!(keep.check(0, "caféé!"), Some(1));
        assert!(r.init(r#"{"pattern": "a*"}"#).unwrap_err().contains("matches the empty string"));
        assert!(r.init(r#"{"pattern": "("}"#).unwrap_err().contains("bad `pattern`"));
        assert!(r.init("{}").unwrap_err().contains("needs a non-empty `pattern`"));
    }
}
