//! Max-sentences stop rule: ends generation once the output holds `n` sentences, keeping
//! the last sentence's end mark and trimming what follows it. A sentence ends at `.`, `!`,
//! `?` (or `。！？`) followed by whitespace, so "3.14" or "e.g.x" do not count.
//! Config: `{"n": 1}`.

use plugin_sdk::StopRule;
use plugin_util::parse;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    n: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config { n: 1 }
    }
}

#[derive(Default)]
pub struct MaxSentences {
    n: usize,
    seen: usize,
    /// The previous character, carried across deltas.
    last: Option<char>,
}

fn ends_sentence(c: char) -> bool {
    matches!(c, '.' | '!' | '?' | '。' | '！' | '？')
}

impl StopRule for MaxSentences {
    fn init(&mut self, config: &str) -> Result<(), String> {
        let c: Config = parse("max-sentences", "config", config)?;
        if c.n == 0 {
            return Err("max-sentences: `n` must be at least 1".into());
        }
        *self = MaxSentences { n: c.n, ..Default::default() };
        Ok(())
    }

    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        self.seen = 0;
        self.last = None;
        Ok(())
    }

    fn check(&mut self, _token: u32, text: &str) -> Option<usize> {
        let total = text.chars().count();
        for (i, c) in text.chars().enumerate() {
            let prev = self.last.replace(c);
            let full_width = prev.is_some_and(|p| matches!(p, '。' | '！' | '？'));
            if prev.is_some_and(ends_sentence) && (c.is_whitespace() || full_width) {
                self.seen += 1;
                if self.seen >= self.n {
                    return Some(total - i);
                }
            }
        }
        None
    }
}

plugin_sdk::export_stop_rule!(
    MaxSentences,
    r#"{"abi": 1, "name": "max-sentences", "version": "0.1.0", "kinds": ["stop"], "stop": {"hold": 8}, "description": "stops after n sentences"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sentence_ends_followed_by_space() {
        let mut m = MaxSentences::default();
        m.init(r#"{"n": 2}"#).unwrap();
        assert_eq!(m.check(0, "Pi is 3.14. It"), None);
        assert_eq!(m.check(0, " is round!"), None);
        assert_eq!(m.check(0, "\nMore"), Some(5));
        let mut cjk = MaxSentences::default();
        cjk.init("{}").unwrap();
        assert_eq!(cjk.check(0, "你好。"), None);
        assert_eq!(cjk.check(0, "再见"), Some(2));
        assert!(m.init(r#"{"n": 0}"#).unwrap_err().contains("at least 1"));
    }
}
