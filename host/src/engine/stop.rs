//! Stop strings over a stream of text pieces. Text that could still turn out to be the
//! start of a stop string is held back until it is resolved, so a stop string is never
//! emitted, not even in part, whatever the token boundaries.

/// The result of feeding one piece of text.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is now safe to emit.
    pub text: String,
    /// Set when a stop string matched; nothing after it is emitted.
    pub stopped: Option<String>,
}

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new() }
    }

    pub fn push(&mut self, piece: &str) -> StopOutput {
        self.held.push_str(piece);
        // The earliest complete match wins.
        let first =
            self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first {
            let text = self.held[..at].to_string();
            let stop = stop.clone();
            self.held.clear();
            return StopOutput { text, stopped: Some(stop) };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let emit_to = self.held.len() - keep;
        let text = self.held[..emit_to].to_string();
        self.held.drain(..emit_to);
        StopOutput { text, stopped: None }
    }

    /// At the end of generation, held-back text was not a stop string after all.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces`; returns the emitted text and the stop string hit, if any.
    fn check(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.text);
            if o.stopped.is_some() {
                return (out, o.stopped);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_never_emitted() {
        assert_eq!(check(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), Some("END".into())));
        assert_eq!(check(&["\n\n"], &["a\n", "\nb"]), ("a".into(), Some("\n\n".into())));
    }

    #[test]
    fn held_text_that_does_not_complete_a_stop_is_released() {
        assert_eq!(check(&["END"], &["E", "N", "d"]), ("ENd".into(), None));
        assert_eq!(check(&["END"], &["xEN"]), ("xEN".into(), None), "flushed at the end");
    }

    #[test]
    fn the_earliest_match_wins_and_multibyte_stops_work() {
        assert_eq!(check(&["bc", "ab"], &["xabc"]), ("x".into(), Some("ab".into())));
        assert_eq!(check(&["é!"], &["caf", "é", "!"]), ("caf".into(), Some("é!".into())));
        assert_eq!(check(&[], &["a", "b"]), ("ab".into(), None));
        assert_eq!(check(&[""], &["a"]), ("a".into(), None));
    }

    #[test]
    fn text_is_emitted_as_soon_as_it_cannot_start_a_stop() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.push("abc S").text, "abc ");
        assert_eq!(m.push("x").text, "Sx");
    }
}
