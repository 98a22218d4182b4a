//! @NAME@: a stop-rule plugin for host (ABI v1, plugin-sdk/ABI.md §5.2), in Zig 0.14.
//! This skeleton ends the reply after its first sentence ('.', '!' or '?'): change
//! stop_check. Build: ./build.sh. Use it with "plugins": {"stop": [{"name": "@NAME@"}]}.

@ALLOC@
/// Called once per generated token with only the text that token added. Return -1 to go on,
/// or n >= 0 to stop and trim the reply's last n characters (at most the manifest's
/// stop.hold): here the characters after the sentence end.
export fn stop_check(token: i32, text: [*]const u8, len: i32) i32 {
    _ = token;
    const bytes = text[0..@intCast(len)];
    for (bytes, 0..) |c, i| {
        if (c == '.' or c == '!' or c == '?') {
            var after: i32 = 0;
            for (bytes[i + 1 ..]) |b| {
                if (b & 0xC0 != 0x80) after += 1;
            }
            return after;
        }
    }
    return -1;
}
