;; A stop-rule plugin in WebAssembly text: stops after the first token whose text holds a
;; sentence end ('.', '!' or '?'), keeping the text. ABI v1, plugin-sdk/ABI.md.
(module
  (@custom "host.plugin" "{\"abi\": 1, \"name\": \"first-sentence\", \"version\": \"1.0.0\", \"kinds\": [\"stop\"]}")
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 65536))
  (func (export "host_alloc") (param $size i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (global.set $heap (i32.add (local.get $ptr) (local.get $size)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536))) (i32.const 65536)) (i32.const 1))))))
    (local.get $ptr))
  (func (export "stop_check") (param $token i32) (param $text i32) (param $len i32) (result i32)
    (local $i i32) (local $c i32)
    (block $done
      (loop $scan
        (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
        (local.set $c (i32.load8_u (i32.add (local.get $text) (local.get $i))))
        (if (i32.or (i32.or (i32.eq (local.get $c) (i32.const 46)) (i32.eq (local.get $c) (i32.const 33))) (i32.eq (local.get $c) (i32.const 63)))
          (then (return (i32.const 0))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $scan)))
    (i32.const -1)))
