/* host plugin ABI v1 for C (and anything that can include a C header).
 * The contract is plugin-sdk/ABI.md; this header mirrors it. If they differ, ABI.md is right.
 *
 * Start from a skeleton: `host plugins new NAME --kind sampler|stop --lang c` writes one with
 * its build.sh. Build a plugin by hand (clang, no libc needed):
 *   clang --target=wasm32 -O2 -nostdlib -Wl,--no-entry -Wl,--export-dynamic -o my.wasm my.c
 * then add the `host.plugin` manifest section (ABI.md §2), which clang cannot emit from C:
 *   host plugins add-manifest my.wasm my.json
 * and check it the way the server loads it: host plugins check my.wasm [--config JSON].
 *
 * Memory: at the plugin's cap (64 MiB unless its NAME.toml says otherwise)
 * __builtin_wasm_memory_grow returns (size_t)-1; host_alloc should then return 0 (a fault of
 * that call, naming the plugin). sampler_accept may bring a long prompt in several calls.
 */
#ifndef HOST_PLUGIN_H
#define HOST_PLUGIN_H

#include <stdint.h>

#define HOST_ABI_VERSION 1

#define HOST_EXPORT(name) __attribute__((export_name(#name), visibility("default")))
#define HOST_IMPORT(name) __attribute__((import_module("host"), import_name(#name)))


/* A top-k candidate as the host writes it: highest logit first (ABI.md §5.1). */
typedef struct {
    uint32_t token;
    float logit;
} host_candidate;

/* The one import: write to the host's log. Levels: 0 error, 1 warn, 2 info, 3 debug. */
HOST_IMPORT(log) void host_log(int32_t level, const char *ptr, int32_t len);

/* Required exports (define them in the plugin):
 *   HOST_EXPORT(host_alloc) int32_t host_alloc(int32_t size);          -- 8-aligned, or 0
 * Optional lifecycle:
 *   HOST_EXPORT(host_init)  int32_t host_init(const char *cfg, int32_t len);          0 = ok
 *   HOST_EXPORT(host_begin) int32_t host_begin(const char *params, int32_t len, int64_t seed);
 *   HOST_EXPORT(host_end)   void host_end(void);
 * Sampler kind:
 *   HOST_EXPORT(sampler_sample) int32_t sampler_sample(int32_t position, host_candidate *c, int32_t n);
 *       returns a token id, or -1 to let the host sample from the (edited) candidates
 *   HOST_EXPORT(sampler_accept) int32_t sampler_accept(const uint32_t *tokens, int32_t n);
 *   HOST_EXPORT(sampler_rollback) int32_t sampler_rollback(int32_t n);
 * Stop kind:
 *   HOST_EXPORT(stop_check) int32_t stop_check(int32_t token, const char *text, int32_t len);
 *       returns -1 to continue, or r >= 0 to stop and trim the last r characters
 */

#endif
