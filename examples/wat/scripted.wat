;; A sampler plugin written by hand in WebAssembly text (ABI v1, plugin-sdk/ABI.md).
;; It ignores the model and forces the token sequence " Paris" "." " Paris" "." ...
;; (SmolLM2 token ids 7042 and 30), counting generated tokens from what the host accepts.
;; Build: host plugins build-wat examples/wat/scripted.wat plugins/scripted.wasm
(module
  (@custom "host.plugin" "{\"abi\": 1, \"name\": \"scripted\", \"version\": \"1.0.0\", \"kinds\": [\"sampler\"], \"sampler\": {\"input\": \"candidates\", \"k\": 4}, \"description\": \"forces Paris. Paris. ...\"}")
  (memory (export "memory") 2)
  ;; The script: two little-endian u32 token ids.
  (data (i32.const 1024) "\82\1b\00\00\1e\00\00\00")
  (global $heap (mut i32) (i32.const 65536))
  (global $prompt (mut i32) (i32.const -1))
  (global $total (mut i32) (i32.const 0))

  ;; Bump allocator for the host's buffers (never freed: an instance lives for one request).
  (func (export "host_alloc") (param $size i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (global.set $heap (i32.add (local.get $ptr) (local.get $size)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536))) (i32.const 65536)) (i32.const 1))))))
    (local.get $ptr))

  ;; The first call brings the prompt; later calls one committed token each.
  (func (export "sampler_accept") (param $ptr i32) (param $n i32) (result i32)
    (if (i32.lt_s (global.get $prompt) (i32.const 0)) (then (global.set $prompt (local.get $n))))
    (global.set $total (i32.add (global.get $total) (local.get $n)))
    (i32.const 0))

  ;; Pure in (history, position): token script[(generated so far) mod 2].
  (func (export "sampler_sample") (param $position i32) (param $cand i32) (param $n i32) (result i32)
    (i32.load (i32.add (i32.const 1024)
      (i32.shl (i32.rem_u (i32.sub (global.get $total) (global.get $prompt)) (i32.const 2)) (i32.const 2))))))
