// @NAME@: a sampler plugin for host (ABI v1, plugin-sdk/ABI.md §5.1), in AssemblyScript.
// This skeleton picks the most likely candidate (greedy decoding at any temperature): change
// sampler_sample. Build: ./build.sh. Use it with "plugins": {"sampler": {"name": "@NAME@"}}.

@ALLOC@
// Candidates: n records of {token: u32, logit: f32} at `candidates`, most likely first.
// Return a token id, or -1 to let the host sample natively from the (edited) candidates. It
// must not change state (ABI.md §5.1).
export function sampler_sample(position: i32, candidates: i32, n: i32): i32 {
  return n > 0 ? <i32>load<u32>(candidates) : -1;
}
