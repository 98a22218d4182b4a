//! `instant::Instant` for a Wasm plugin: ABI v1 gives plugins no clock, and llguidance only
//! times its own steps for its logs, so every instant is the same one and every duration is
//! zero. The workspace patches crates.io's `instant` with this crate; only the `guidance`
//! plugin (llguidance's `wasm` feature) uses it.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant;

impl Instant {
    pub fn now() -> Instant {
        Instant
    }
    pub fn elapsed(&self) -> Duration {
        Duration::ZERO
    }
    pub fn duration_since(&self, _earlier: Instant) -> Duration {
        Duration::ZERO
    }
}

impl std::ops::Sub for Instant {
    type Output = Duration;
    fn sub(self, _other: Instant) -> Duration {
        Duration::ZERO
    }
}

impl std::ops::Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, _d: Duration) -> Instant {
        Instant
    }
}
