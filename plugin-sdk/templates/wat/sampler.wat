;; @NAME@: a sampler plugin for host (ABI v1, plugin-sdk/ABI.md §5.1), written by hand in
;; WebAssembly text. This skeleton picks the most likely candidate (greedy decoding at any
;; temperature): change sampler_sample. Build: ./build.sh (`host plugins build-wat` keeps the
;; manifest below; wabt's wat2wasm drops it: then add it with `host plugins add-manifest`).
;; Use it with "plugins": {"sampler": {"name": "@NAME@"}} in a request.
(module
  (@custom "host.plugin" "@MANIFEST_WAT@")
@ALLOC@
  ;; Candidates: $n records of {token: u32, logit: f32} at $cand, most likely first. Return
  ;; a token id, or -1 to let the host sample natively. It must not change state.
  (func (export "sampler_sample") (param $position i32) (param $cand i32) (param $n i32) (result i32)
    (if (result i32) (i32.gt_s (local.get $n) (i32.const 0))
      (then (i32.load (local.get $cand)))
      (else (i32.const -1)))))
