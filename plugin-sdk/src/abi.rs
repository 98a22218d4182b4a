//! The raw ABI v1 (see ABI.md): the `host.log` import, the allocator, and the export macros.
//! Everything `unsafe` or `extern "C"` in the SDK is here.

#[cfg(target_arch = "wasm32")]
#[link(wasm_import_module = "host")]
extern "C" {
    #[link_name = "log"]
    fn host_log(level: i32, ptr: i32, len: i32);
}

pub fn log(level: i32, message: &str) {
    #[cfg(target_arch = "wasm32")]
    // SAFETY: the host reads `len` bytes at `ptr` from this module's memory during the call.
    unsafe {
        host_log(level, message.as_ptr() as i32, message.len() as i32)
    };
    #[cfg(not(target_arch = "wasm32"))]
    let _ = (level, message);
}

/// `host_alloc`: memory the host keeps for its buffers until the instance ends (leaked on
/// purpose: an instance serves one request).
pub fn alloc(size: i32) -> i32 {
    let words = (size.max(0) as usize).div_ceil(8);
    let buffer: &'static mut [u64] = Vec::leak(vec![0u64; words.max(1)]);
    buffer.as_mut_ptr() as usize as i32
}

/// Reads `len` bytes the host wrote at `ptr`.
///
/// # Safety
/// `ptr..ptr+len` must be a buffer the host filled (one `alloc` returned).
pub unsafe fn bytes<'a>(ptr: i32, len: i32) -> &'a mut [u8] {
    // SAFETY: the caller guarantees the range lies in a live host buffer.
    unsafe { core::slice::from_raw_parts_mut(ptr as usize as *mut u8, len.max(0) as usize) }
}

/// The manifest bytes for a custom section, from a string constant.
pub const fn manifest_bytes<const N: usize>(json: &str) -> [u8; N] {
    let src = json.as_bytes();
    let mut out = [0u8; N];
    let mut i = 0;
    while i < N {
        out[i] = src[i];
        i += 1;
    }
    out
}

/// What every plugin exports: the manifest section, the instance state, the allocator,
/// `host_init` and `host_begin`, for a type implementing `$trait`.
#[doc(hidden)]
#[macro_export]
macro_rules! __export_common {
    ($ty:ty, $trait:path, $manifest:expr) => {
        const MANIFEST: &str = $manifest;
        #[link_section = "host.plugin"]
        #[used]
        static SECTION: [u8; MANIFEST.len()] = $crate::abi::manifest_bytes::<{ MANIFEST.len() }>(MANIFEST);

        static mut STATE: Option<$ty> = None;
        fn state() -> &'static mut $ty {
            // SAFETY: a wasm instance is single-threaded and the host never re-enters it.
            unsafe { (*core::ptr::addr_of_mut!(STATE)).get_or_insert_with(<$ty as Default>::default) }
        }
        fn text(ptr: i32, len: i32) -> &'static str {
            // SAFETY: the host wrote `len` bytes of UTF-8 into a buffer it allocated.
            core::str::from_utf8(unsafe { $crate::abi::bytes(ptr, len) }).unwrap_or("")
        }
        #[no_mangle]
        extern "C" fn host_alloc(size: i32) -> i32 {
            $crate::abi::alloc(size)
        }
        #[no_mangle]
        extern "C" fn host_init(ptr: i32, len: i32) -> i32 {
            use $trait as Kind;
            match Kind::init(state(), text(ptr, len)) {
                Ok(()) => 0,
                Err(e) => {
                    $crate::log(0, &e);
                    1
                }
            }
        }
        #[no_mangle]
        extern "C" fn host_begin(ptr: i32, len: i32, seed: i64) -> i32 {
            use $trait as Kind;
            match Kind::begin(state(), text(ptr, len), seed as u64) {
                Ok(()) => 0,
                Err(e) => {
                    $crate::log(0, &e);
                    1
                }
            }
        }
    };
}

/// Exports a [`Sampler`](crate::Sampler) type with its manifest JSON.
#[macro_export]
macro_rules! export_sampler {
    ($ty:ty, $manifest:expr) => {
        const _: () = {
            $crate::__export_common!($ty, $crate::Sampler, $manifest);
            #[no_mangle]
            extern "C" fn sampler_accept(ptr: i32, n: i32) -> i32 {
                // SAFETY: the host wrote `n` little-endian u32 token ids at `ptr`.
                let raw = unsafe { $crate::abi::bytes(ptr, n * 4) };
                let tokens: Vec<u32> =
                    raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                $crate::Sampler::accept(state(), &tokens);
                0
            }
            #[no_mangle]
            extern "C" fn sampler_rollback(n: i32) -> i32 {
                if $crate::Sampler::rollback(state(), n as usize) {
                    0
                } else {
                    1
                }
            }
            #[no_mangle]
            extern "C" fn sampler_sample(position: i32, ptr: i32, n: i32) -> i32 {
                // SAFETY: the host wrote `n` 8-byte {u32, f32} records at `ptr`, 8-aligned.
                let candidates = unsafe {
                    core::slice::from_raw_parts_mut(ptr as usize as *mut $crate::Candidate, n.max(0) as usize)
                };
                match $crate::Sampler::sample(state(), position as usize, candidates) {
                    $crate::Choice::Token(t) => t as i32,
                    $crate::Choice::Defer => -1,
                }
            }
        };
    };
}

/// Exports a [`StopRule`](crate::StopRule) type with its manifest JSON.
#[macro_export]
macro_rules! export_stop_rule {
    ($ty:ty, $manifest:expr) => {
        const _: () = {
            $crate::__export_common!($ty, $crate::StopRule, $manifest);
            #[no_mangle]
            extern "C" fn stop_check(token: i32, ptr: i32, len: i32) -> i32 {
                match $crate::StopRule::check(state(), token as u32, text(ptr, len)) {
                    Some(trim) => trim as i32,
                    None => -1,
                }
            }
        };
    };
}

/// Keeps `bytes` alive until the plugin's next call and returns them as a packed slice
/// (`ptr << 32 | len`; `0` for none).
pub fn packed(keep: &'static mut Vec<u8>, bytes: Vec<u8>) -> i64 {
    *keep = bytes;
    if keep.is_empty() {
        return 0;
    }
    ((keep.as_ptr() as usize as i64) << 32) | keep.len() as i64
}

/// Exports a [`ToolAdapter`](crate::ToolAdapter) type with its manifest JSON.
#[macro_export]
macro_rules! export_tool_adapter {
    ($ty:ty, $manifest:expr) => {
        const _: () = {
            $crate::__export_common!($ty, $crate::ToolAdapter, $manifest);
            static mut OUT: Vec<u8> = Vec::new();
            fn out() -> &'static mut Vec<u8> {
                // SAFETY: single-threaded instance; the host copies the result before the next call.
                unsafe { &mut *core::ptr::addr_of_mut!(OUT) }
            }
            fn lines(events: Vec<$crate::ToolEvent>) -> i64 {
                let mut text = String::new();
                for e in &events {
                    text.push_str(&e.to_json());
                    text.push('\n');
                }
                $crate::abi::packed(out(), text.into_bytes())
            }
            #[no_mangle]
            extern "C" fn tool_feed(ptr: i32, len: i32) -> i64 {
                let mut events = Vec::new();
                $crate::ToolAdapter::feed(state(), text(ptr, len), &mut events);
                lines(events)
            }
            #[no_mangle]
            extern "C" fn tool_finish() -> i64 {
                let mut events = Vec::new();
                $crate::ToolAdapter::finish(state(), &mut events);
                lines(events)
            }
            #[no_mangle]
            extern "C" fn tool_render(ptr: i32, len: i32) -> i64 {
                let rendered = $crate::ToolAdapter::render(state(), text(ptr, len)).unwrap_or_default();
                $crate::abi::packed(out(), rendered.into_bytes())
            }
            #[no_mangle]
            extern "C" fn tool_force(ptr: i32, len: i32) -> i64 {
                let opener = $crate::ToolAdapter::force(state(), text(ptr, len)).unwrap_or_default();
                $crate::abi::packed(out(), opener.into_bytes())
            }
            #[no_mangle]
            extern "C" fn tool_render_calls(ptr: i32, len: i32) -> i64 {
                let written = $crate::ToolAdapter::render_calls(state(), text(ptr, len)).unwrap_or_default();
                $crate::abi::packed(out(), written.into_bytes())
            }
            #[no_mangle]
            extern "C" fn tool_grammar(ptr: i32, len: i32) -> i64 {
                let grammar = $crate::ToolAdapter::grammar(state(), text(ptr, len)).unwrap_or_default();
                $crate::abi::packed(out(), grammar.into_bytes())
            }
            #[no_mangle]
            extern "C" fn tool_trigger() -> i64 {
                let trigger = $crate::ToolAdapter::trigger(state()).unwrap_or_default();
                $crate::abi::packed(out(), trigger.into_bytes())
            }
        };
    };
}

/// Exports a [`ReasoningParser`](crate::ReasoningParser) type with its manifest JSON.
#[macro_export]
macro_rules! export_reasoning_parser {
    ($ty:ty, $manifest:expr) => {
        const _: () = {
            $crate::__export_common!($ty, $crate::ReasoningParser, $manifest);
            static mut OUT: Vec<u8> = Vec::new();
            fn lines(events: Vec<$crate::ReasoningEvent>) -> i64 {
                let mut text = String::new();
                for e in &events {
                    text.push_str(&e.to_json());
                    text.push('\n');
                }
                // SAFETY: single-threaded instance; the host copies the result before the next call.
                $crate::abi::packed(unsafe { &mut *core::ptr::addr_of_mut!(OUT) }, text.into_bytes())
            }
            #[no_mangle]
            extern "C" fn reasoning_feed(ptr: i32, len: i32) -> i64 {
                let mut events = Vec::new();
                $crate::ReasoningParser::feed(state(), text(ptr, len), &mut events);
                lines(events)
            }
            #[no_mangle]
            extern "C" fn reasoning_finish() -> i64 {
                let mut events = Vec::new();
                $crate::ReasoningParser::finish(state(), &mut events);
                lines(events)
            }
        };
    };
}

/// Exports a [`Scheduler`](crate::Scheduler) type with its manifest JSON; with `drafts` after
/// them, its [`DraftScheduler`](crate::DraftScheduler) answer too (the optional
/// `schedule_drafts` export).
#[macro_export]
macro_rules! export_scheduler {
    ($ty:ty, $manifest:expr) => {
        $crate::export_scheduler!(@with $ty, $manifest, {});
    };
    ($ty:ty, $manifest:expr, drafts) => {
        $crate::export_scheduler!(@with $ty, $manifest, {
            static mut DRAFTS: Vec<u8> = Vec::new();
            #[no_mangle]
            extern "C" fn schedule_drafts(ptr: i32, len: i32) -> i64 {
                let budgets = $crate::DraftScheduler::schedule_drafts(state(), text(ptr, len));
                // SAFETY: single-threaded instance; the host copies the result before the next call.
                $crate::abi::packed(unsafe { &mut *core::ptr::addr_of_mut!(DRAFTS) }, budgets.into_bytes())
            }
        });
    };
    (@with $ty:ty, $manifest:expr, { $($extra:tt)* }) => {
        const _: () = {
            $crate::__export_common!($ty, $crate::Scheduler, $manifest);
            static mut OUT: Vec<u8> = Vec::new();
            #[no_mangle]
            extern "C" fn schedule(ptr: i32, len: i32) -> i64 {
                let decision = $crate::Scheduler::schedule(state(), text(ptr, len));
                // SAFETY: single-threaded instance; the host copies the result before the next call.
                $crate::abi::packed(unsafe { &mut *core::ptr::addr_of_mut!(OUT) }, decision.into_bytes())
            }
            $($extra)*
        };
    };
}

/// Exports a [`Constraint`](crate::Constraint) type with its manifest JSON.
#[macro_export]
macro_rules! export_constraint {
    ($ty:ty, $manifest:expr) => {
        const _: () = {
            $crate::__export_common!($ty, $crate::Constraint, $manifest);
            fn status(r: Result<(), String>) -> i32 {
                match r {
                    Ok(()) => 0,
                    Err(e) => {
                        $crate::log(0, &e);
                        1
                    }
                }
            }
            #[no_mangle]
            extern "C" fn constraint_vocab(ptr: i32, len: i32) -> i32 {
                // SAFETY: the host wrote `len` bytes of the encoded vocabulary at `ptr`.
                let raw = unsafe { $crate::abi::bytes(ptr, len) };
                status($crate::Vocab::parse(raw).and_then(|v| $crate::Constraint::vocab(state(), v)))
            }
            #[no_mangle]
            extern "C" fn constraint_mask(ptr: i32, words: i32) -> i32 {
                // SAFETY: the host zeroed `words` u32 words at `ptr`, 4-aligned.
                let bits = unsafe { core::slice::from_raw_parts_mut(ptr as usize as *mut u32, words.max(0) as usize) };
                match $crate::Constraint::mask(state(), bits) {
                    Ok($crate::Allowed::Anything) => 0,
                    Ok($crate::Allowed::End) => 1,
                    Ok($crate::Allowed::Tokens) => 2,
                    Err(e) => {
                        $crate::log(0, &e);
                        -1
                    }
                }
            }
            #[no_mangle]
            extern "C" fn constraint_accept(token: i32) -> i32 {
                status($crate::Constraint::accept(state(), token as u32))
            }
            #[no_mangle]
            extern "C" fn constraint_rollback(n: i32) -> i32 {
                status($crate::Constraint::rollback(state(), n.max(0) as usize))
            }
        };
    };
}
