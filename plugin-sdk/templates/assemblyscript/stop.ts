// @NAME@: a stop-rule plugin for host (ABI v1, plugin-sdk/ABI.md §5.2), in AssemblyScript.
// This skeleton ends the reply after its first sentence ('.', '!' or '?'): change
// stop_check. Build: ./build.sh. Use it with "plugins": {"stop": [{"name": "@NAME@"}]}.

@ALLOC@
// Called once per generated token with only the UTF-8 text that token added (`len` bytes at
// `text`). Return -1 to go on, or n >= 0 to stop and trim the reply's last n characters (at
// most the manifest's stop.hold): here the characters after the sentence end.
export function stop_check(token: i32, text: i32, len: i32): i32 {
  for (let i = 0; i < len; i++) {
    const c = load<u8>(text + i);
    if (c == 46 || c == 33 || c == 63) {
      let after = 0;
      for (let j = i + 1; j < len; j++) {
        if ((load<u8>(text + j) & 0xc0) != 0x80) after++;
      }
      return after;
    }
  }
  return -1;
}
