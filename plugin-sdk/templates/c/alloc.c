extern unsigned char __heap_base;
static uintptr_t heap = 0;

/* The host's buffers: a bump allocator (an instance serves one request, so nothing is
 * freed). Returns 0 when memory runs out: at the plugin's memory limit memory.grow fails. */
HOST_EXPORT(host_alloc) int32_t host_alloc(int32_t size) {
    if (size < 0) return 0;
    if (heap == 0) heap = (uintptr_t)&__heap_base;
    uintptr_t ptr = (heap + 7) & ~(uintptr_t)7;
    uintptr_t end = ptr + (uintptr_t)size;
    uintptr_t have = __builtin_wasm_memory_size(0) * 65536;
    if (end > have && __builtin_wasm_memory_grow(0, (end - have + 65535) / 65536) == (uintptr_t)-1) return 0;
    heap = end;
    return (int32_t)ptr;
}
