/* @NAME@: a sampler plugin for host (ABI v1, plugin-sdk/ABI.md §5.1), in C.
 * This skeleton picks the most likely candidate (greedy decoding at any temperature): change
 * sampler_sample. Build: ./build.sh (clang and lld). Use it with
 * "plugins": {"sampler": {"name": "@NAME@"}} in a request. */
#include "plugin.h"

@ALLOC@
/* Candidates come sorted, most likely first. Return a token id, or -1 to let the host sample
 * natively from the (edited) candidates. It must not change state (ABI.md §5.1). */
HOST_EXPORT(sampler_sample) int32_t sampler_sample(int32_t position, host_candidate *c, int32_t n) {
    (void)position;
    return n > 0 ? (int32_t)c[0].token : -1;
}
