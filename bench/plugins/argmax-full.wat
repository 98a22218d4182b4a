;; Benchmark plugin: a full-vocabulary sampler (declares "input": "logits") that takes the
;; argmax of the whole logits row in Wasm. ABI v1.
(module
  (@custom "host.plugin" "{\"abi\": 1, \"name\": \"argmax-full\", \"version\": \"1.0.0\", \"kinds\": [\"sampler\"], \"sampler\": {\"input\": \"logits\"}}")
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 65536))
  (func (export "host_alloc") (param $size i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (i32.and (i32.add (local.get $size) (i32.const 7)) (i32.const -8))))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536))) (i32.const 65536)) (i32.const 1))))))
    (local.get $ptr))
  (func (export "sampler_sample") (param $position i32) (param $ptr i32) (param $n i32) (result i32)
    (local $i i32) (local $best i32) (local $v f32) (local $max f32)
    (local.set $max (f32.load (local.get $ptr)))
    (local.set $i (i32.const 1))
    (block $done
      (loop $scan
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (local.set $v (f32.load (i32.add (local.get $ptr) (i32.shl (local.get $i) (i32.const 2)))))
        (if (f32.gt (local.get $v) (local.get $max))
          (then (local.set $max (local.get $v)) (local.set $best (local.get $i))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $scan)))
    (local.get $best)))
