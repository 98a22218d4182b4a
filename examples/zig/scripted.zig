//! The scripted sampler of examples/wat/scripted.wat, in Zig: forces " Paris" "." " Paris" "."
//! (SmolLM2 token ids 7042 and 30). ABI v1, plugin-sdk/ABI.md. Build: examples/zig/build.sh
//! OUT.wasm (Zig from PyPI's `ziglang`), which also appends the manifest from scripted.json.

const script = [_]u32{ 7042, 30 };
var prompt: i32 = -1;

// The host's buffers come from a bump allocator over a static arena; an instance serves one
// request, so nothing is ever freed.
var arena: [1 << 20]u8 align(8) = undefined;
var used: usize = 0;

export fn host_alloc(size: i32) i32 {
    if (size < 0) return 0;
    const start = (used + 7) & ~@as(usize, 7);
    const end = start + @as(usize, @intCast(size));
    if (end > arena.len) return 0;
    used = end;
    return @intCast(@intFromPtr(&arena[start]));
}

/// Token script[(generated so far) mod 2]. The first call comes after the whole prompt
/// (which sampler_accept, not needed here, may bring in several calls), so its position is
/// the prompt's length; from then on the result depends only on the position.
export fn sampler_sample(position: i32, candidates: [*]const u8, n: i32) i32 {
    _ = candidates;
    _ = n;
    if (prompt < 0) prompt = position;
    return @intCast(script[@intCast(@mod(position - prompt, 2))]);
}
