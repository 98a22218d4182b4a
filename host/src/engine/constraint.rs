//! Constrained decoding: a row's constraint says which tokens may come next, and the decode
//! loops set the logits of the tokens it refuses to -inf before any sampler sees them,
//! native or plugin. The mask of a step is computed on the CPU while the
//! device runs that step's forward (the loops start the logits first), and a speculative
//! verification gets one mask per drafted position, the drafts accepted tentatively and
//! rolled back before the committed tokens are told.
//!
//! The engine knows constraints only through [`Constraint`]; what they are made from (a JSON
//! schema, a regex, a grammar, a plugin) is the server's business (`crate::structured`).

use super::SamplingParams;
use anyhow::{bail, Result};
use mlx::{Array, Dtype};
use std::borrow::Cow;
use std::sync::Arc;

/// What a constraint allows at the next position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allowed {
    /// Any token.
    Anything,
    /// Only an end-of-sequence token: the constrained output is complete.
    End,
    /// The tokens whose bit is set: bit `t % 32` of word `t / 32`. A model's end-of-sequence
    /// token among them allows all of its end-of-sequence tokens.
    Tokens(Vec<u32>),
}

impl Allowed {
    /// Whether token `id` may come next (`eos`: the model's end-of-sequence tokens).
    pub fn permits(&self, id: u32, eos: &[u32]) -> bool {
        match self {
            Allowed::Anything => true,
            Allowed::End => eos.contains(&id),
            Allowed::Tokens(bits) => {
                let set = |t: u32| bits.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
                set(id) || (eos.contains(&id) && eos.iter().any(|&e| set(e)))
            }
        }
    }
}

/// A constraint over one request's output, told every token it is held to.
pub trait Constraint: Send {
    /// The tokens allowed at the next position.
    fn allowed(&mut self) -> Result<Allowed>;
    /// `token` comes next (committed, or drafted and perhaps rolled back). End-of-sequence
    /// tokens are not passed: they end the output.
    fn accept(&mut self, token: u32) -> Result<()>;
    /// Forgets the last `tokens` accepted.
    fn rollback(&mut self, tokens: usize) -> Result<()>;
}

/// How a request's constraint is made: compiled once when the request arrives (so a bad
/// spec is refused there), started on the engine thread when the request starts.
#[derive(Clone)]
pub struct ConstraintSpec {
    /// What it is, for logs ("json_schema", "regex", a plugin's name).
    pub kind: String,
    start: Arc<dyn Fn(u64) -> Result<Box<dyn Constraint>> + Send + Sync>,
    prepare: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for ConstraintSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintSpec").field("kind", &self.kind).finish_non_exhaustive()
    }
}

impl ConstraintSpec {
    pub fn new(
        kind: impl Into<String>,
        start: impl Fn(u64) -> Result<Box<dyn Constraint>> + Send + Sync + 'static,
    ) -> Self {
        ConstraintSpec { kind: kind.into(), start: Arc::new(start), prepare: None }
    }

    /// With `prepare`: the part of a start that does not need the seed and takes a while
    /// (a constraint plugin's instance and its vocabulary tables), done ahead by
    /// [`prepare`](Self::prepare) for the next start to take.
    pub fn with_prepare(mut self, prepare: impl Fn() + Send + Sync + 'static) -> Self {
        self.prepare = Some(Arc::new(prepare));
        self
    }

    /// Does the slow part of the next start now, on the calling thread: the server calls it
    /// before the request reaches the engine, so the engine thread, which every running
    /// request waits on, does not build a plugin's tables (the built-in `guidance` plugin
    /// takes 155-710 ms for them).
    pub fn prepare(&self) {
        if let Some(prepare) = &self.prepare {
            prepare();
        }
    }

    /// A fresh constraint for a request whose random seed is `seed`.
    pub fn start(&self, seed: u64) -> Result<Box<dyn Constraint>> {
        (self.start)(seed)
    }
}

/// A constraint that cannot go on mid-output (a grammar past llguidance's limits at a later
/// position than its first): the request's fault, told to the client as a 400 naming the
/// field (`param`), not an internal error.
#[derive(Debug)]
pub struct ConstraintFailed {
    pub param: &'static str,
    pub message: String,
}

impl std::fmt::Display for ConstraintFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConstraintFailed {}

/// A step's masks go to helper threads when they took longer than this together.
pub const PARALLEL_MASKS_SECS: f64 = 150e-6;

/// Masks (of one constraint, or of a batch step's constraints together) that take longer than
/// this on average are worked out on a helper thread beside the next forward's start, the
/// token waited for there too; quicker ones on the engine thread (a helper costs ~20-50 µs
/// to start and join). Measured on the H200 (bench/RESULTS.md, session 25): llguidance's
/// JSON-schema and regex masks (0.06-0.4 ms) gain 0.1x there; the lowercase plugin's
/// (0.02 ms) lost as much.
pub const SLOW_MASK_SECS: f64 = 50e-6;

/// Threads for constraint work beside the engine thread: at most 8.
fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8))
}

/// The threads constraint work runs on beside the engine thread, kept from step to step
/// (starting one costs ~20-40 µs, and a batch step of slow masks started up to 8). `None`
/// under `HOST_MASK_POOL=spawn` (a measuring switch: threads started per call, as before),
/// or if the pool could not be made.
fn pool() -> Option<&'static rayon_core::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon_core::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        if std::env::var("HOST_MASK_POOL").is_ok_and(|v| v == "spawn") {
            return None;
        }
        let built = rayon_core::ThreadPoolBuilder::new()
            .num_threads(threads())
            .thread_name(|i| format!("host-constraint-{i}"))
            .build();
        built.map_err(|e| tracing::warn!("constraint threads: {e}; starting them per step instead")).ok()
    })
    .as_ref()
}

/// Runs `helper` on another thread while `here` runs on this one, and gives both results
/// (a panic in either goes on in the caller).
pub fn beside<A: Send, B>(helper: impl FnOnce() -> A + Send, here: impl FnOnce() -> B) -> (A, B) {
    match pool() {
        Some(pool) => {
            let mut helped = None;
            let mine = pool.in_place_scope(|scope| {
                scope.spawn(|_| helped = Some(helper()));
                here()
            });
            (helped.expect("the scope waits for its helper"), mine)
        }
        None => std::thread::scope(|scope| {
            let helper = scope.spawn(helper);
            let mine = here();
            (helper.join().unwrap_or_else(|p| std::panic::resume_unwind(p)), mine)
        }),
    }
}

/// `work` on each of `items` (in their order): on helper threads when there are several and
/// `serial` (the seconds they would take one after another) is over [`PARALLEL_MASKS_SECS`],
/// the calling thread taking the first share, else on this thread.
pub fn each<T: Send, R: Send>(items: Vec<T>, serial: f64, work: impl Fn(T) -> R + Sync) -> Vec<R> {
    let threads = threads();
    if items.len() < 2 || threads < 2 || serial < PARALLEL_MASKS_SECS {
        return items.into_iter().map(work).collect();
    }
    let per = items.len().div_ceil(threads.min(items.len()));
    let mut chunks: Vec<Vec<T>> = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        if i % per == 0 {
            chunks.push(Vec::with_capacity(per));
        }
        chunks.last_mut().expect("a chunk").push(item);
    }
    let work = &work;
    let run = move |chunk: Vec<T>| chunk.into_iter().map(work).collect::<Vec<_>>();
    let mine = chunks.remove(0);
    match pool() {
        Some(pool) => {
            let mut theirs: Vec<Vec<R>> = chunks.iter().map(|_| Vec::new()).collect();
            let mut out = pool.in_place_scope(|scope| {
                for (chunk, slot) in chunks.into_iter().zip(theirs.iter_mut()) {
                    scope.spawn(move |_| *slot = run(chunk));
                }
                run(mine)
            });
            out.extend(theirs.into_iter().flatten());
            out
        }
        None => std::thread::scope(|scope| {
            let helpers: Vec<_> = chunks.into_iter().map(|c| scope.spawn(move || run(c))).collect();
            let mut out = run(mine);
            for h in helpers {
                out.extend(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            }
            out
        }),
    }
}

/// A row's constraint as the decode loops use it: masks as bitsets of allowed tokens,
/// end-of-sequence tokens kept out of the constraint, tentative drafts rolled back.
pub struct Guard {
    inner: Box<dyn Constraint>,
    eos: Vec<u32>,
    vocab: usize,
    /// Masks computed and the seconds spent on them (the constraint's part and building
    /// the row), for `DecodeStats`.
    pub masks: usize,
    pub mask_secs: f64,
    /// Tokens told to the constraint and the seconds that took.
    pub accepts: usize,
    pub accept_secs: f64,
}

impl Guard {
    /// Starts `spec` for a request whose random seed is `seed`, on a model of `vocab` tokens
    /// whose end-of-sequence tokens are `eos`.
    pub fn start(spec: &ConstraintSpec, seed: u64, eos: &[u32], vocab: usize) -> Result<Guard> {
        Ok(Guard {
            inner: spec.start(seed)?,
            eos: eos.to_vec(),
            vocab,
            masks: 0,
            mask_secs: 0.0,
            accepts: 0,
            accept_secs: 0.0,
        })
    }

    /// Whether its masks have taken long enough (over `SLOW_MASK_SECS` on average) that
    /// working one out beside other host work pays for a helper thread (~20 µs to start).
    pub fn slow(&self) -> bool {
        self.mean_secs() > SLOW_MASK_SECS
    }

    /// Seconds a mask has taken on average (0 before the first).
    pub fn mean_secs(&self) -> f64 {
        self.mask_secs / self.masks.max(1) as f64
    }

    /// The mask of the next position: the allowed tokens as a bitset of `V` bits (bit
    /// `t % 32` of word `t / 32`); `None` when anything goes.
    pub fn mask(&mut self) -> Result<Option<Bits>> {
        let allowed = self.allowed()?;
        self.mask_of(&allowed)
    }

    /// Each guard's [`mask`](Self::mask), tagged with its `key`: on helper threads when there
    /// are several whose masks took over [`PARALLEL_MASKS_SECS`] together so far (a batch's
    /// llguidance rows over a 128K vocabulary, ~0.2 ms a mask each; the rows' masks are
    /// independent), else on this thread (starting a thread costs ~20 µs).
    pub fn masks<K: Send>(guards: Vec<(K, &mut Guard)>) -> Vec<(K, Result<Option<Bits>>)> {
        let serial: f64 = guards.iter().map(|(_, g)| g.mean_secs()).sum();
        each(guards, serial, |(k, g)| (k, g.mask()))
    }

    fn allowed(&mut self) -> Result<Allowed> {
        let started = std::time::Instant::now();
        let allowed = self.inner.allowed();
        self.masks += 1;
        self.mask_secs += started.elapsed().as_secs_f64();
        let allowed = allowed?;
        // Nothing allowed is the constraint's way of saying it is finished.
        Ok(match allowed {
            Allowed::Tokens(bits) if bits.iter().all(|&w| w == 0) => Allowed::End,
            a => a,
        })
    }

    fn mask_of(&self, allowed: &Allowed) -> Result<Option<Bits>> {
        if *allowed == Allowed::Anything {
            return Ok(None);
        }
        if *allowed == Allowed::End && self.eos.is_empty() {
            bail!("the constraint is complete, but the model has no end-of-sequence token to end the output with");
        }
        let mut bits = match allowed {
            Allowed::Tokens(bits) => bits.clone(),
            _ => Vec::new(),
        };
        bits.resize(self.vocab.div_ceil(32), 0);
        // Bits past the vocabulary name no token (a forced one would be fed to the model).
        if let (Some(last), tail @ 1..) = (bits.last_mut(), self.vocab % 32) {
            *last &= (1u32 << tail) - 1;
        }
        for &e in &self.eos {
            if (e as usize) < self.vocab && allowed.permits(e, &self.eos) {
                bits[e as usize / 32] |= 1 << (e % 32);
            }
        }
        Ok(Some(bits))
    }

    /// Whether `id` ends the output (an end-of-sequence token).
    pub fn ends(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// A committed token (end-of-sequence tokens end the output and are not passed on).
    pub fn accept(&mut self, id: u32) -> Result<()> {
        if self.eos.contains(&id) {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let accepted = self.inner.accept(id);
        self.accepts += 1;
        self.accept_secs += started.elapsed().as_secs_f64();
        accepted
    }

    /// The masks of a verification's `drafts.len() + 1` positions (from the last committed
    /// token's), each `None` where anything goes. Drafts are accepted tentatively and rolled
    /// back; past the first draft the constraint refuses, nothing is asked (the target's
    /// token there differs from the draft, so no later position is committed).
    pub fn draft_masks(&mut self, drafts: &[u32]) -> Result<Vec<Option<Bits>>> {
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        let mut fed = 0;
        let result = (|| -> Result<()> {
            for i in 0..=drafts.len() {
                let allowed = self.allowed()?;
                masks.push(self.mask_of(&allowed)?);
                let Some(&d) = drafts.get(i) else { break };
                if !allowed.permits(d, &self.eos) || self.eos.contains(&d) {
                    break;
                }
                self.inner.accept(d)?;
                fed += 1;
            }
            Ok(())
        })();
        if fed > 0 {
            self.inner.rollback(fed)?;
        }
        result?;
        masks.resize_with(drafts.len() + 1, || None);
        Ok(masks)
    }
}

/// A mask's hash, for finding it among the kept ones (FxHash's mixing, two words at a time:
/// a few µs for a 128K vocabulary's 4,008 words).
fn hash_words(words: &[u32]) -> u64 {
    let mix = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    let pairs = words.chunks_exact(2);
    let tail = pairs.remainder().first().map_or(0, |&w| w as u64 | 1 << 32);
    mix(pairs.fold(words.len() as u64, |h, p| mix(h, p[0] as u64 | (p[1] as u64) << 32)), tail)
}

/// A mask: the allowed tokens' bits (bit `t % 32` of word `t / 32`).
pub type Bits = Vec<u32>;

/// The token a mask allows, when it allows exactly one.
pub fn only_token(mask: &[u32]) -> Option<u32> {
    let mut words = mask.iter().enumerate().filter(|(_, w)| **w != 0);
    let (i, w) = words.next()?;
    (w.count_ones() == 1 && words.next().is_none()).then(|| i as u32 * 32 + w.trailing_zeros())
}

/// What applying masks needs on the device besides the masks: the 32 powers of two, `0`
/// and `-inf` (in the logits' dtype), the token ids for `forced`, and the masks met lately,
/// expanded there. A generation or a batch keeps one. On the H200 a mask made from host
/// memory is the constrained step's largest cost: a 128K vocabulary's 16 KB bitset, sent,
/// expanded and applied, cost its sampling 0.35 ms against 0.15 ms for one already there
/// (`bench/device/pick-cost.py`, bench/RESULTS.md session 27) — the device's buffers are
/// managed memory, whose pages move to the host for the copy and back for the kernel. A
/// constraint's masks repeat (a JSON string's characters, a regex's loop, a plugin's rule),
/// so each mask is sent once and kept, expanded, while it is among the last `KEPT_MASKS` used.
#[derive(Default)]
pub struct Masking {
    /// `[1, 32]` u32 powers of two and u32 `0`.
    bits: Option<(Array, Array)>,
    neg_inf: Option<(Dtype, Array)>,
    /// `[1, V]` int32 token ids, for `forced`.
    ids: Option<Array>,
    /// Masks met lately: each one's words, its hash, the `apply` call it was last used in
    /// (`uses` counts them), and its `[1, V]` bool row on the device (true where refused).
    /// Least recently used goes first.
    kept: Vec<Kept>,
    /// An all-false `[1, V]` row, for rows without a mask beside rows with one.
    open_row: Option<Array>,
    uses: u64,
    /// Masks applied, and of them those sent from the host (not kept from before).
    pub applied: usize,
    pub sent: usize,
}

struct Kept {
    hash: u64,
    words: Bits,
    last_used: u64,
    refused: Array,
}

/// How many expanded masks a `Masking` keeps (a 128K vocabulary's take 128 KB each).
pub const KEPT_MASKS: usize = 64;

/// `KEPT_MASKS`, or for measuring `HOST_KEPT_MASKS` (0: every mask sent every time).
fn kept_masks() -> usize {
    static KEPT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KEPT.get_or_init(|| std::env::var("HOST_KEPT_MASKS").ok().and_then(|v| v.parse().ok()).unwrap_or(KEPT_MASKS))
}

impl Masking {
    /// Applies the masks of rows (`masks[i]` for row `i` of `logits`, `[N, V]`; an error
    /// unless there are N): a refused token's logit becomes -inf; rows without a mask are
    /// left as they are. Masks met lately
    /// are used as kept on the device; the rest go there together (`V / 8` bytes a row) and
    /// are expanded in one go, then kept.
    pub fn apply(&mut self, logits: &Array, masks: &[Option<Bits>]) -> Result<Array> {
        if masks.iter().all(Option::is_none) {
            return Ok(logits.clone());
        }
        let vocab = logits.dim(-1);
        let words = vocab.div_ceil(32);
        // Each mask as `words` words (a guard's are already), with its hash.
        let wanted: Vec<Option<(u64, Cow<'_, [u32]>)>> = (masks.iter())
            .map(|m| {
                m.as_ref().map(|m| {
                    let m = match m.len() == words {
                        true => Cow::Borrowed(m.as_slice()),
                        false => {
                            let mut m = m[..m.len().min(words)].to_vec();
                            m.resize(words, 0);
                            Cow::Owned(m)
                        }
                    };
                    (hash_words(&m), m)
                })
            })
            .collect();
        if kept_masks() == 0 || self.kept.first().is_some_and(|k| k.refused.dim(-1) != vocab) {
            self.kept.clear();
        }
        let find = |kept: &[Kept], (hash, words): &(u64, Cow<'_, [u32]>)| {
            kept.iter().position(|k| k.hash == *hash && k.words == **words)
        };
        self.uses += 1;
        let mut fresh: Vec<&(u64, Cow<'_, [u32]>)> = Vec::new();
        for w in wanted.iter().flatten() {
            self.applied += 1;
            match find(&self.kept, w) {
                Some(i) => self.kept[i].last_used = self.uses,
                None if !fresh.contains(&w) => fresh.push(w),
                None => {}
            }
        }
        if !fresh.is_empty() {
            // Room for the new ones: the least recently used go, never one this call uses.
            while self.kept.len() + fresh.len() > kept_masks() {
                let unused = self.kept.iter().enumerate().filter(|(_, k)| k.last_used < self.uses);
                let Some((i, _)) = unused.min_by_key(|(_, k)| k.last_used) else { break };
                self.kept.swap_remove(i);
            }
            self.sent += fresh.len();
            let all: Vec<u32> = fresh.iter().flat_map(|(_, w)| w.iter().copied()).collect();
            let refused = self.refused(&all, fresh.len(), vocab)?;
            let several = fresh.len() > 1;
            for (j, (hash, words)) in fresh.into_iter().enumerate() {
                let refused = refused.slice_axis(0, j as i32, j as i32 + 1)?;
                // A row of several gets a buffer of its own: a view would keep all of
                // them on the device for as long as any one is kept.
                let refused = if several { refused.copy()? } else { refused };
                self.kept.push(Kept { hash: *hash, words: words.to_vec(), last_used: self.uses, refused });
            }
        }
        let mut rows = Vec::with_capacity(wanted.len());
        for w in &wanted {
            rows.push(match w {
                Some(w) => self.kept[find(&self.kept, w).expect("kept above")].refused.clone(),
                None => self.open_row(vocab)?,
            });
        }
        // One kernel on a GPU, reading the rows where they lie (`masked_rows`).
        let rows: Vec<&Array> = rows.iter().collect();
        Ok(mlx::ops::masked_rows(logits, &rows, self.neg_inf(logits.dtype())?)?)
    }

    /// An all-false `[1, vocab]` row (nothing refused), kept.
    fn open_row(&mut self, vocab: usize) -> Result<Array> {
        if self.open_row.as_ref().is_none_or(|r| r.dim(-1) != vocab) {
            self.open_row = Some(Array::zeros(&[1, vocab], Dtype::Bool)?);
        }
        Ok(self.open_row.clone().expect("just set"))
    }

    /// The log-probabilities of tokens their masks force, one row each (`[K, vocab]` in
    /// `dtype`): 0 for the token and -inf for the rest, what `apply` and a log-softmax give a
    /// position whose mask allows one token — built without the logits or the masks (a
    /// forced run's rows are rarely read: only for the API's `logprobs`).
    pub fn forced(&mut self, tokens: &[u32], vocab: usize, dtype: Dtype) -> Result<Array> {
        if self.ids.as_ref().is_none_or(|ids| ids.dim(-1) != vocab) {
            self.ids = Some(Array::arange(0.0, vocab as f64, 1.0, Dtype::Int32)?.expand_dims(&[0])?);
        }
        let ids = self.ids.as_ref().expect("just set");
        let tokens: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let chosen = ids.equal(&Array::from_i32(&tokens, &[tokens.len(), 1])?)?;
        Ok(mlx::ops::where_(&chosen, &Array::scalar(0.0, dtype)?, self.neg_inf(dtype)?)?)
    }

    /// `-inf` in `dtype`, kept.
    fn neg_inf(&mut self, dtype: Dtype) -> Result<&Array> {
        if self.neg_inf.as_ref().is_none_or(|(d, _)| *d != dtype) {
            self.neg_inf = Some((dtype, Array::scalar(f32::NEG_INFINITY, dtype)?));
        }
        Ok(&self.neg_inf.as_ref().expect("just set").1)
    }

    /// `rows` bitsets of `vocab` bits (one after another, whole words each) as `[rows,
    /// vocab]` bool, true where a bit is clear: word `w`'s bit `b` is clear when `w & 2^b`
    /// is 0 (two kernels).
    fn refused(&mut self, bits: &[u32], rows: usize, vocab: usize) -> Result<Array> {
        let words = Array::from_u32(bits, &[bits.len(), 1])?;
        if self.bits.is_none() {
            let pow2: Vec<u32> = (0..32).map(|b| 1u32 << b).collect();
            self.bits = Some((Array::from_u32(&pow2, &[1, 32])?, Array::scalar(0.0, Dtype::Uint32)?));
        }
        let (pow2, zero) = self.bits.as_ref().expect("just set");
        let refused = words.bitwise_and(pow2)?.equal(zero)?;
        Ok(refused.reshape(&[rows as i32, -1])?.slice_axis(1, 0, vocab as i32)?)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A constraint for tests: position `i` of its output allows only `allowed[i]` (then the
    /// end), recording what it was told.
    pub struct Script {
        pub allowed: Vec<Vec<u32>>,
        pub accepted: Vec<u32>,
        pub vocab: usize,
    }

    impl Constraint for Script {
        fn allowed(&mut self) -> Result<Allowed> {
            let Some(set) = self.allowed.get(self.accepted.len()) else { return Ok(Allowed::End) };
            let mut bits = vec![0u32; self.vocab.div_ceil(32)];
            for &t in set {
                bits[t as usize / 32] |= 1 << (t % 32);
            }
            Ok(Allowed::Tokens(bits))
        }
        fn accept(&mut self, token: u32) -> Result<()> {
            let ok = self.allowed.get(self.accepted.len()).is_some_and(|s| s.contains(&token));
            if !ok {
                bail!("token {token} is not allowed at output position {}", self.accepted.len());
            }
            self.accepted.push(token);
            Ok(())
        }
        fn rollback(&mut self, tokens: usize) -> Result<()> {
            let n = self.accepted.len();
            if tokens > n {
                bail!("cannot roll back {tokens} of {n} tokens");
            }
            self.accepted.truncate(n - tokens);
            Ok(())
        }
    }

    pub fn script(allowed: Vec<Vec<u32>>, vocab: usize) -> ConstraintSpec {
        ConstraintSpec::new("script", move |_| {
            Ok(Box::new(Script { allowed: allowed.clone(), accepted: Vec::new(), vocab }) as Box<dyn Constraint>)
        })
    }

    /// [`Masking::apply`] with its constants built anew.
    pub fn apply(logits: &Array, masks: &[Option<Bits>]) -> Result<Array> {
        Masking::default().apply(logits, masks)
    }

    #[test]
    fn constraint_work_beside_the_engine_thread_keeps_its_order_and_its_panics() {
        let here = std::thread::current().id();
        let slow = each((0..20).collect(), 1.0, |i: usize| (i * 2, std::thread::current().id()));
        assert_eq!(slow.iter().map(|o| o.0).collect::<Vec<_>>(), (0..20).map(|i| i * 2).collect::<Vec<_>>());
        assert_eq!(slow[0].1, here, "the caller takes the first share");
        assert!(threads() < 2 || slow.iter().any(|o| o.1 != here), "slow work is shared with helpers");
        let quick = each(vec![1, 2, 3], 0.0, |_: i32| std::thread::current().id());
        assert!(quick.iter().all(|&t| t == here), "quick work stays on the calling thread");
        let (helped, mine) = beside(|| std::thread::current().id(), || std::thread::current().id());
        assert!(helped != here && mine == here);
        // The helpers are the kept pool's threads, not ones started for the call.
        if std::env::var("HOST_MASK_POOL").map_or(true, |v| v != "spawn") {
            let (name, _) = beside(|| std::thread::current().name().map(str::to_owned), || ());
            assert!(name.is_some_and(|n| n.starts_with("host-constraint-")));
            let slow = each((0..4).collect(), 1.0, |_: i32| std::thread::current().name().map(str::to_owned));
            let last = slow.last().expect("four results").as_deref();
            assert!(threads() < 2 || last.is_some_and(|n| n.starts_with("host-constraint-")), "{slow:?}");
        }
        // Twice: the pool's threads are kept, and a helper's panic reaches the caller.
        for _ in 0..2 {
            let broke = std::panic::catch_unwind(|| beside(|| -> i32 { panic!("the helper broke") }, || 1));
            assert!(broke.is_err());
            assert_eq!(beside(|| 2, || 3), (2, 3));
        }
    }

    #[test]
    fn a_mask_forces_a_token_only_when_it_allows_that_one_alone() {
        let mut mask = vec![0u32; 4];
        assert_eq!(only_token(&mask), None, "nothing allowed");
        mask[2] = 1 << 5;
        assert_eq!(only_token(&mask), Some(69));
        mask[3] = 1;
        assert_eq!(only_token(&mask), None, "two words");
        mask[3] = 0;
        mask[2] |= 1 << 31;
        assert_eq!(only_token(&mask), None, "two bits of a word");
        assert_eq!(only_token(&[0, 0x8000_0000]), Some(63));
    }

    /// The tokens a mask allows, read through `apply` on the device.
    pub fn open(mask: &Option<Bits>, vocab: usize) -> Vec<usize> {
        let logits = Array::zeros(&[1, vocab], Dtype::Float32).unwrap();
        let row = apply(&logits, std::slice::from_ref(mask)).unwrap().to_vec_f32().unwrap();
        assert!(row.iter().all(|&x| x == 0.0 || x == f32::NEG_INFINITY));
        (0..vocab).filter(|&t| row[t] == 0.0).collect()
    }

    /// A batch's masks computed on helper threads come back with their rows' keys, each
    /// row's own (and a failing row's error with it); cheap ones stay on this thread.
    #[test]
    fn masks_of_several_guards_come_back_keyed_to_their_rows() {
        let vocab = 40;
        let mut guards: Vec<Guard> =
            (0..7u32).map(|i| Guard::start(&script(vec![vec![i, 30 + i]], vocab), 0, &[39], vocab).unwrap()).collect();
        let broken = ConstraintSpec::new("broken", |_| {
            struct Broken;
            impl Constraint for Broken {
                fn allowed(&mut self) -> Result<Allowed> {
                    bail!("broken at the first mask")
                }
                fn accept(&mut self, _: u32) -> Result<()> {
                    Ok(())
                }
                fn rollback(&mut self, _: usize) -> Result<()> {
                    Ok(())
                }
            }
            Ok(Box::new(Broken) as Box<dyn Constraint>)
        });
        guards.push(Guard::start(&broken, 0, &[39], vocab).unwrap());
        for slow in [false, true] {
            for g in &mut guards {
                // As if each mask took 1 s (helper threads) or nothing (this thread).
                (g.masks, g.mask_secs) = (1, if slow { 1.0 } else { 0.0 });
            }
            let keyed: Vec<(usize, &mut Guard)> = guards.iter_mut().enumerate().map(|(i, g)| (10 + i, g)).collect();
            let mut out = Guard::masks(keyed);
            out.sort_by_key(|(k, _)| *k);
            assert_eq!(out.iter().map(|(k, _)| *k).collect::<Vec<_>>(), (10..18).collect::<Vec<_>>());
            for (k, mask) in out {
                let i = (k - 10) as u32;
                match mask {
                    Ok(Some(bits)) => {
                        assert_eq!(open(&Some(bits), vocab), vec![i as usize, 30 + i as usize], "row {i}");
                    }
                    other => assert!(i == 7 && other.is_err_and(|e| e.to_string().contains("broken")), "row {i}"),
                }
            }
        }
    }

    #[test]
    fn masks_allow_exactly_the_permitted_tokens_and_every_eos_with_one() {
        let vocab = 70;
        let spec = script(vec![vec![3, 33, 69], vec![5, 1]], vocab);
        let mut g = Guard::start(&spec, 0, &[1, 2], vocab).unwrap();
        assert_eq!(open(&g.mask().unwrap(), vocab), vec![3, 33, 69]);
        g.accept(33).unwrap();
        assert_eq!(open(&g.mask().unwrap(), vocab), vec![1, 2, 5], "eos 1 allowed stands for eos 2 as well");
        g.accept(5).unwrap();
        assert_eq!(open(&g.mask().unwrap(), vocab), vec![1, 2], "a complete constraint allows only the end");
        g.accept(2).unwrap();
        assert!(g.accept(7).is_err(), "a token the constraint refuses is an error");
        // A bit past the vocabulary names no token: cleared, so 69 alone is forced.
        let mut g = Guard::start(&script(vec![vec![69, 75]], vocab), 0, &[1, 2], vocab).unwrap();
        assert_eq!(g.mask().unwrap().as_deref().and_then(only_token), Some(69));
    }

    #[test]
    fn draft_masks_follow_the_drafts_and_leave_the_constraint_where_it_was() {
        let vocab = 40;
        let spec = script(vec![vec![3], vec![4], vec![5]], vocab);
        let mut g = Guard::start(&spec, 0, &[0], vocab).unwrap();
        let open = |m: &Option<Bits>| open(m, vocab);
        let masks = g.draft_masks(&[3, 4]).unwrap();
        assert_eq!(masks.len(), 3);
        assert_eq!(open(&masks[0]), vec![3]);
        assert_eq!(open(&masks[1]), vec![4]);
        assert_eq!(open(&masks[2]), vec![5]);
        // A refused draft: positions after it are not constrained (never committed).
        let masks = g.draft_masks(&[3, 9, 5]).unwrap();
        assert_eq!(open(&masks[1]), vec![4]);
        assert!(masks[2].is_none() && masks[3].is_none());
        // Rolled back: the first position is still the first.
        assert_eq!(open(&g.mask().unwrap()), vec![3]);
    }

    /// The bitsets expand on the device into -inf logits exactly where they are clear, in the
    /// logits' own dtype, for the masked rows of a batch only.
    #[test]
    fn apply_sends_refused_tokens_to_minus_infinity_in_masked_rows_only() {
        let vocab = 70;
        let mask = |ts: &[u32]| {
            let mut g = Guard::start(&script(vec![ts.to_vec()], vocab), 0, &[], vocab).unwrap();
            g.mask().unwrap()
        };
        let logits = Array::from_f32(&vec![1.5; 3 * vocab], &[3, vocab]).unwrap().astype(Dtype::Bfloat16).unwrap();
        let out = apply(&logits, &[mask(&[0, 3, 31, 32, 33, 69]), None, mask(&[1, 64])]).unwrap();
        assert_eq!(out.dtype(), Dtype::Bfloat16);
        let out = out.to_vec_f32().unwrap();
        let row = |r: usize| -> Vec<usize> { (0..vocab).filter(|&t| out[r * vocab + t] == 1.5).collect() };
        assert_eq!(row(0), vec![0, 3, 31, 32, 33, 69]);
        assert_eq!(row(1), (0..vocab).collect::<Vec<_>>(), "the unmasked row is as it was");
        assert_eq!(row(2), vec![1, 64]);
        assert!(out.iter().all(|&x| x == 1.5 || x == f32::NEG_INFINITY));
    }

    /// Masks met before are used as kept on the device (not sent again) and give what a
    /// fresh one gives; one evicted (over `KEPT_MASKS` newer ones) is sent again.
    #[test]
    fn masks_met_before_are_kept_on_the_device_and_apply_as_sent_ones() {
        let vocab = 70;
        // Allows token t and those above it up to t + 3 (so masks differ by t).
        let mask = |t: u32| -> Bits {
            let mut bits = vec![0u32; 3];
            for u in t..(t + 4).min(vocab as u32) {
                bits[u as usize / 32] |= 1 << (u % 32);
            }
            bits
        };
        let open_of = |out: &Array, rows: usize| -> Vec<Vec<usize>> {
            let out = out.to_vec_f32().unwrap();
            (0..rows).map(|r| (0..vocab).filter(|&t| out[r * vocab + t].is_finite()).collect()).collect()
        };
        let logits = Array::from_f32(&vec![0.5; 3 * vocab], &[3, vocab]).unwrap();
        let mut masking = Masking::default();
        let out = masking.apply(&logits, &[Some(mask(5)), None, Some(mask(40))]).unwrap();
        assert_eq!(open_of(&out, 3), vec![vec![5, 6, 7, 8], (0..vocab).collect(), vec![40, 41, 42, 43]]);
        assert_eq!((masking.applied, masking.sent), (2, 2));
        // The same two again, swapped and repeated, and one new one twice: one more sent.
        let out = masking.apply(&logits, &[Some(mask(40)), Some(mask(66)), Some(mask(66))]).unwrap();
        assert_eq!(open_of(&out, 3), vec![vec![40, 41, 42, 43], vec![66, 67, 68, 69], vec![66, 67, 68, 69]]);
        let one = Array::from_f32(&vec![0.5; vocab], &[1, vocab]).unwrap();
        let out = masking.apply(&one, &[Some(mask(5))]).unwrap();
        assert_eq!(open_of(&out, 1), vec![vec![5, 6, 7, 8]]);
        assert_eq!((masking.applied, masking.sent), (6, 3));
        // A shorter bitset (missing words are clear) is the same mask.
        let out = masking.apply(&one, &[Some(vec![0xF << 5])]).unwrap();
        assert_eq!(open_of(&out, 1), vec![vec![5, 6, 7, 8]]);
        assert_eq!((masking.applied, masking.sent), (7, 3));
        // KEPT_MASKS newer masks push mask(5) out (mask(0) .. used one at a time: the
        // least recently used goes first); mask(5) is then sent again, still right.
        let fillers: Vec<Bits> = (0..KEPT_MASKS).map(|i| vec![i as u32 + 1, 1 << 31, 0]).collect();
        for f in &fillers {
            masking.apply(&one, &[Some(f.clone())]).unwrap();
        }
        assert_eq!(masking.sent, 3 + KEPT_MASKS);
        let out = masking.apply(&one, &[Some(mask(5))]).unwrap();
        assert_eq!(open_of(&out, 1), vec![vec![5, 6, 7, 8]]);
        assert_eq!(masking.sent, 4 + KEPT_MASKS);
        // The newest filler was kept.
        masking.apply(&one, &[Some(fillers[KEPT_MASKS - 1].clone())]).unwrap();
        assert_eq!(masking.sent, 4 + KEPT_MASKS);
        // A mask for each row, or a clear error.
        let e = masking.apply(&logits, &[Some(mask(5))]).unwrap_err().to_string();
        assert!(e.contains("B refused rows"), "{e}");
    }

    #[test]
    fn a_complete_constraint_without_an_eos_token_is_an_error() {
        let mut g = Guard::start(&script(vec![], 8), 0, &[], 8).unwrap();
        let e = g.mask().unwrap_err().to_string();
        assert!(e.contains("no end-of-sequence token"), "{e}");
    }
}

/// When a constrained step works out its mask, which needs the token before it. For
/// measuring (`bench/device/constrained-steps.sh`); `HOST_MASK_OVERLAP` (`auto`, `always`,
/// `merged`, `never`) picks it. Measured on the H200 (bench/RESULTS.md, session 25): slow
/// masks (llguidance's JSON schema and regex on llama-1b) gain 0.1x from the helper thread
/// (0.98x and 0.89x against 0.86x and 0.78x never), quick ones lose to its start; where the
/// token is already there and the mask quick (SmolLM2, the lowercase plugin), one dispatch
/// for forward and sampling (merged) gave 1.00-1.10x against 0.83-0.98x. Two more ways were
/// measured and dropped (session 24), both one dispatch a step with the token read on this
/// thread before it, waiting: the mask worked out beside building the next forward
/// (0.63-0.75x), and a step's sampling started together with the next forward (0.50-0.76x
/// on llama-1b; 0.79-0.89x again in session 27, `bench/device/constrained-loop.py` in
/// mlx-lm's own model, a second stream for the sampling no better). The device finishes a
/// step 0.5-1 ms after MLX has started all of it, and a token read right after its dispatch
/// waits that long on every step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Overlap {
    /// Slow masks (`Guard::slow`) beside the next forward's start (`Generation::overlapped`);
    /// quick ones before it, forward and sampling then started as one (`Generation::merged`),
    /// when the token is already there once that forward is built, else after it.
    Auto,
    /// Always beside the next forward's start, the token waited for on a helper thread.
    Always,
    /// Always before it, forward and sampling started as one, waiting for the token first.
    Merged,
    /// Always after the next forward's start.
    Never,
}

impl Overlap {
    pub(crate) fn from_env() -> Overlap {
        match std::env::var("HOST_MASK_OVERLAP").as_deref() {
            Ok("always") => Overlap::Always,
            Ok("merged") => Overlap::Merged,
            Ok("never") => Overlap::Never,
            _ => Overlap::Auto,
        }
    }

    /// Whether a constrained step's token is waited for, told to the constraint and the next
    /// mask worked out on a helper thread beside the next forward's start, the masks being
    /// `slow` (a generation's: `Guard::slow`; a batch step's together: over `SLOW_MASK_SECS`).
    pub(crate) fn beside(self, slow: bool) -> bool {
        match self {
            Overlap::Always => true,
            Overlap::Auto => slow,
            Overlap::Merged | Overlap::Never => false,
        }
    }

    /// Whether a constrained step not worked out beside (`beside`) is worked out before the
    /// next forward's start, forward and sampling then one dispatch: under `Auto` when the
    /// token is already there (`available`, asked only then); else it is after the start.
    pub(crate) fn merges(self, available: impl FnOnce() -> bool) -> bool {
        match self {
            Overlap::Merged => true,
            Overlap::Auto => available(),
            Overlap::Always | Overlap::Never => false,
        }
    }
}

/// The most tokens a constraint's forced run (`Generation::forced_run`) feeds in one forward.
pub(super) const MAX_FORCED_RUN: usize = 32;

/// Whether tokens a constraint forces are committed in runs (`Generation::forced_run`);
/// `HOST_FORCED_RUNS=off` turns it off, for measuring.
pub fn forced_runs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HOST_FORCED_RUNS").as_deref() != Ok("off"))
}

/// Whether a request goes faster decoding alone, as a generation, than as a batch's only
/// row: under a constraint, whose forced tokens only a generation takes in runs (one forward
/// for many, no sampling), unless a plugin sampler (serial either way) or penalties over the
/// history (no runs) are in play.
pub fn takes_forced_runs(constrained: bool, external: bool, params: &SamplingParams) -> bool {
    constrained && !external && !params.needs_history() && forced_runs()
}
