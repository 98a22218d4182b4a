/* The scripted sampler of examples/wat/scripted.wat, in C: forces " Paris" "." " Paris" "."
 * (SmolLM2 token ids 7042 and 30). Build: examples/c/build.sh OUT.wasm, which also appends
 * the manifest from scripted.json. */
#include "../../plugin-sdk/include/plugin.h"

static const uint32_t script[2] = {7042, 30};
static int32_t prompt = -1;

extern unsigned char __heap_base;
static uintptr_t heap = 0;

HOST_EXPORT(host_alloc) int32_t host_alloc(int32_t size) {
    if (heap == 0) heap = (uintptr_t)&__heap_base;
    uintptr_t ptr = (heap + 7) & ~(uintptr_t)7;
    uintptr_t end = ptr + (uintptr_t)size;
    uintptr_t have = __builtin_wasm_memory_size(0) * 65536;
    if (end > have && __builtin_wasm_memory_grow(0, (end - have + 65535) / 65536) == (uintptr_t)-1) return 0;
    heap = end;
    return (int32_t)ptr;
}

/* The first call comes after the whole prompt (which sampler_accept, not needed here, may
 * bring in several calls), so its position is the prompt's length; from then on the result
 * depends only on the position. */
HOST_EXPORT(sampler_sample) int32_t sampler_sample(int32_t position, host_candidate *c, int32_t n) {
    (void)c; (void)n;
    if (prompt < 0) prompt = position;
    return (int32_t)script[(position - prompt) % 2];
}
