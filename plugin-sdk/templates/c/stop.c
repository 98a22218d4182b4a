/* @NAME@: a stop-rule plugin for host (ABI v1, plugin-sdk/ABI.md §5.2), in C.
 * This skeleton ends the reply after its first sentence ('.', '!' or '?'): change stop_check.
 * Build: ./build.sh (clang and lld). Use it with "plugins": {"stop": [{"name": "@NAME@"}]}. */
#include "plugin.h"

@ALLOC@
/* Called once per generated token with only the text that token added. Return -1 to go on,
 * or n >= 0 to stop and trim the reply's last n characters (at most the manifest's
 * stop.hold): here the characters after the sentence end. */
HOST_EXPORT(stop_check) int32_t stop_check(int32_t token, const char *text, int32_t len) {
    (void)token;
    for (int32_t i = 0; i < len; i++) {
        if (text[i] == '.' || text[i] == '!' || text[i] == '?') {
            int32_t after = 0;
            for (int32_t j = i + 1; j < len; j++) after += ((unsigned char)text[j] & 0xC0) != 0x80;
            return after;
        }
    }
    return -1;
}
