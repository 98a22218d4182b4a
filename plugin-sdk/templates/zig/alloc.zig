// The host's buffers: a bump allocator over memory past the program's data (an instance
// serves one request, so nothing is freed). Returns 0 when memory runs out: at the plugin's
// memory limit memory.grow fails.
extern var __heap_base: u8;
var heap: usize = 0;

export fn host_alloc(size: i32) i32 {
    if (size < 0) return 0;
    if (heap == 0) heap = @intFromPtr(&__heap_base);
    const start = (heap + 7) & ~@as(usize, 7);
    const end = start + @as(usize, @intCast(size));
    const have = @wasmMemorySize(0) * 65536;
    if (end > have and @wasmMemoryGrow(0, (end - have + 65535) / 65536) < 0) return 0;
    heap = end;
    return @intCast(start);
}
