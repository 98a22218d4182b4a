;; @NAME@: a stop-rule plugin for host (ABI v1, plugin-sdk/ABI.md §5.2), written by hand in
;; WebAssembly text. This skeleton ends the reply after its first sentence ('.', '!' or '?'):
;; change stop_check. Build: ./build.sh (`host plugins build-wat` keeps the manifest below;
;; wabt's wat2wasm drops it: then add it with `host plugins add-manifest`).
;; Use it with "plugins": {"stop": [{"name": "@NAME@"}]} in a request.
(module
  (@custom "host.plugin" "@MANIFEST_WAT@")
@ALLOC@
  ;; Called once per generated token with only the text it added ($len bytes at $text).
  ;; -1 goes on; n >= 0 stops and trims the reply's last n characters (at most the
  ;; manifest's stop.hold): here the characters after the sentence end.
  (func (export "stop_check") (param $token i32) (param $text i32) (param $len i32) (result i32)
    (local $i i32) (local $c i32) (local $after i32)
    (block $none
      (loop $scan
        (br_if $none (i32.ge_u (local.get $i) (local.get $len)))
        (local.set $c (i32.load8_u (i32.add (local.get $text) (local.get $i))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br_if $scan (i32.eqz (i32.or (i32.or (i32.eq (local.get $c) (i32.const 46)) (i32.eq (local.get $c) (i32.const 33))) (i32.eq (local.get $c) (i32.const 63)))))
        ;; Count the characters (UTF-8 lead bytes) after it.
        (block $counted
          (loop $count
            (br_if $counted (i32.ge_u (local.get $i) (local.get $len)))
            (if (i32.ne (i32.and (i32.load8_u (i32.add (local.get $text) (local.get $i))) (i32.const 0xc0)) (i32.const 0x80))
              (then (local.set $after (i32.add (local.get $after) (i32.const 1)))))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br $count)))
        (return (local.get $after))))
    (i32.const -1)))
