/* The scripted sampler of examples/wat/scripted.wat, in C: forces " Paris" "." " Paris" "."
 * (SmolLM2 token ids 7042 and 30). Build: examples/c/build.sh OUT.wasm, which also appends
 * the manifest from scripted.json. */
#include "../../plugin-sdk/include/plugin.h"

static const uint32_t script[2] = {7042, 30};
static int32_t prompt = -1;
static int32_t total = 0;

extern unsigned char __heap_base;
static uintptr_t heap = 0;

HOST_EXPORT(host_alloc) int32_t host_alloc(int32_t size) {
    if (heap == 0) heap = (uintptr_t)&__heap_base;
    uintptr_t ptr = (heap + 7) & ~(uintptr_t)7;
    uintptr_t end = ptr + (uintptr_t)size;
    uintptr_t have = __builtin_wasm_memory_size(0) * 65536;
    if (end > have && __builtin_wasm_memory_grow(0, (end - have + 65535) / 65536) < 0) return 0;
    heap = end;
    return (int32_t)ptr;
}

HOST_EXPORT(sampler_accept) int32_t sampler_accept(const uint32_t *tokens, int32_t n) {
    (void)tokens;
    if (prompt < 0) prompt = n;
    total += n;
    return 0;
}

HOST_EXPORT(sampler_sample) int32_t sampler_sample(int32_t position, host_candidate *c, int32_t n) {
    (void)position; (void)c; (void)n;
    return (int32_t)script[(total - prompt) % 2];
}
