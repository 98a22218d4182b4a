// The host's buffers: AssemblyScript's own heap (the stub runtime is a bump allocator; an
// instance serves one request, so nothing needs freeing). It traps when memory runs out,
// which the host reports as the plugin's memory limit.
export function host_alloc(size: i32): i32 {
  return <i32>heap.alloc(<usize>size);
}
