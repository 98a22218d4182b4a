// The scripted sampler of examples/wat/scripted.wat, in AssemblyScript: forces " Paris" "."
// " Paris" "." (SmolLM2 token ids 7042 and 30). ABI v1, plugin-sdk/ABI.md. Build:
// examples/assemblyscript/build.sh OUT.wasm (AssemblyScript 0.28 from npm), which also adds
// the manifest from scripted.json.

const SCRIPT: StaticArray<u32> = [7042, 30];
let prompt: i32 = -1;

// The host's buffers: AssemblyScript's own heap (the stub runtime is a bump allocator; an
// instance serves one request, so nothing needs freeing). It traps when memory runs out,
// which the host reports as the plugin's memory limit.
export function host_alloc(size: i32): i32 {
  return <i32>heap.alloc(<usize>size);
}

// Token SCRIPT[(generated so far) mod 2]. The first call comes after the whole prompt (which
// sampler_accept, not needed here, may bring in several calls), so its position is the
// prompt's length; from then on the result depends only on the position.
export function sampler_sample(position: i32, candidates: i32, n: i32): i32 {
  if (prompt < 0) prompt = position;
  return <i32>SCRIPT[(position - prompt) % 2];
}
