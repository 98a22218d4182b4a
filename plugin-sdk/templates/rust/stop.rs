//! @NAME@: a stop-rule plugin for host (ABI v1, plugin-sdk/ABI.md §5.2).
//! This skeleton ends the reply after its first sentence ('.', '!' or '?'): change `check`.
//! Use it with `"plugins": {"stop": [{"name": "@NAME@"}]}` in a request.

use plugin_sdk::StopRule;

#[derive(Default)]
pub struct Plugin;

impl StopRule for Plugin {
    /// Called once per generated token with only the text that token added (keep your own
    /// window to match across tokens). `Some(n)` stops and trims the last `n` characters of
    /// the reply (at most the manifest's `stop.hold`); `None` goes on.
    fn check(&mut self, _token: u32, text: &str) -> Option<usize> {
        let end = text.find(['.', '!', '?'])?;
        Some(text[end + 1..].chars().count())
    }
}

plugin_sdk::export_stop_rule!(Plugin, r#"@MANIFEST@"#);
