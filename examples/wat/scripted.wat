;; A sampler plugin written by hand in WebAssembly text (ABI v1, plugin-sdk/ABI.md).
;; It ignores the model and forces the token sequence " Paris" "." " Paris" "." ...
;; (SmolLM2 token ids 7042 and 30), counting generated tokens from the position it samples.
;; Build: host plugins build-wat examples/wat/scripted.wat plugins/scripted.wasm
(module
  (@custom "host.plugin" "{\"abi\": 1, \"name\": \"scripted\", \"version\": \"1.0.0\", \"kinds\": [\"sampler\"], \"sampler\": {\"input\": \"candidates\", \"k\": 4}, \"description\": \"forces Paris. Paris. ...\"}")
  (memory (export "memory") 2)
  ;; The script: two little-endian u32 token ids.
  (data (i32.const 1024) "\82\1b\00\00\1e\00\00\00")
  (global $heap (mut i32) (i32.const 65536))
  (global $prompt (mut i32) (i32.const -1))

  ;; Bump allocator for the host's buffers (never freed: an instance lives for one request).
  (func (export "host_alloc") (param $size i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (global.set $heap (i32.add (local.get $ptr) (local.get $size)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536))) (i32.const 65536)) (i32.const 1))))))
    (local.get $ptr))

  ;; Token script[(generated so far) mod 2]. The first call comes after the whole prompt
  ;; (which sampler_accept, not needed here, may bring in several calls), so its position is
  ;; the prompt's length; from then on the result depends only on the position.
  (func (export "sampler_sample") (param $position i32) (param $cand i32) (param $n i32) (result i32)
    (if (i32.lt_s (global.get $prompt) (i32.const 0)) (then (global.set $prompt (local.get $position))))
    (i32.load (i32.add (i32.const 1024)
      (i32.shl (i32.rem_u (i32.sub (local.get $position) (global.get $prompt)) (i32.const 2)) (i32.const 2))))))
