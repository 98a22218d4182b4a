//! The scripted sampler of examples/wat/scripted.wat, in Zig: forces " Paris" "." " Paris" "."
//! (SmolLM2 token ids 7042 and 30). ABI v1, plugin-sdk/ABI.md. Build: examples/zig/build.sh
//! OUT.wasm (Zig from PyPI's `ziglang`), which also appends the manifest from scripted.json.

const script = [_]u32{ 7042, 30 };
var prompt: i32 = -1;
var total: i32 = 0;

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

/// The first call brings the prompt; later calls one committed token each.
export fn sampler_accept(tokens: [*]const u32, n: i32) i32 {
    _ = tokens;
    if (prompt < 0) prompt = n;
    total += n;
    return 0;
}

/// Pure in (history, position): token script[(generated so far) mod 2].
export fn sampler_sample(position: i32, candidates: [*]const u8, n: i32) i32 {
    _ = position;
    _ = candidates;
    _ = n;
    return @intCast(script[@intCast(@mod(total - prompt, 2))]);
}
