  (memory (export "memory") 2)
  ;; The host's buffers: a bump allocator from 64 KiB up (an instance serves one request, so
  ;; nothing is freed). Returns 0 when memory runs out: at the plugin's memory limit
  ;; memory.grow returns -1.
  (global $heap (mut i32) (i32.const 65536))
  (func (export "host_alloc") (param $size i32) (result i32)
    (local $ptr i32) (local $end i32) (local $have i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (local.set $end (i32.add (local.get $ptr) (local.get $size)))
    (local.set $have (i32.mul (memory.size) (i32.const 65536)))
    (if (i32.gt_u (local.get $end) (local.get $have))
      (then (if (i32.eq (memory.grow (i32.add (i32.shr_u (i32.sub (local.get $end) (local.get $have)) (i32.const 16)) (i32.const 1))) (i32.const -1))
        (then (return (i32.const 0))))))
    (global.set $heap (local.get $end))
    (local.get $ptr))
