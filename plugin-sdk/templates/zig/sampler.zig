//! @NAME@: a sampler plugin for host (ABI v1, plugin-sdk/ABI.md §5.1), in Zig 0.14.
//! This skeleton picks the most likely candidate (greedy decoding at any temperature): change
//! sampler_sample. Build: ./build.sh. Use it with "plugins": {"sampler": {"name": "@NAME@"}}.

@ALLOC@
/// A top-k candidate as the host writes it.
const Candidate = extern struct { token: u32, logit: f32 };

/// Candidates come sorted, most likely first. Return a token id, or -1 to let the host
/// sample natively from the (edited) candidates. It must not change state (ABI.md §5.1).
export fn sampler_sample(position: i32, candidates: [*]const Candidate, n: i32) i32 {
    _ = position;
    if (n <= 0) return -1;
    return @intCast(candidates[0].token);
}
