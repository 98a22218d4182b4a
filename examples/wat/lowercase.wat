;; A constraint plugin in WebAssembly text: the output is lower-case words (a-z) separated
;; by single spaces; it may end once it has a token. ABI v1, plugin-sdk/ABI.md §5.6.
;;
;; constraint_vocab reads every token's bytes once and keeps one flag byte per token:
;;   1 the token is only a-z and spaces, 2 it starts with a space, 4 it ends with one,
;;   8 it is an end-of-sequence token;
;; and from them the three masks there can be, as bitsets: at the start (no leading space,
;; no end yet), after a space (no leading space) and after a letter. constraint_mask copies
;; one of them out. The state is the history of accepted tokens' flags (a stack, so a
;; rollback is a pop).
(module
  (@custom "host.plugin" "{\"abi\": 1, \"name\": \"lowercase\", \"version\": \"1.0.0\", \"kinds\": [\"constraint\"], \"description\": \"only lower-case words, single spaces\"}")
  (import "host" "log" (func $log (param i32 i32 i32)))
  (memory (export "memory") 2)
  (data (i32.const 1024) "the vocabulary is truncated")
  (data (i32.const 1056) "more than a million tokens accepted")
  (global $heap (mut i32) (i32.const 65536))
  ;; The last letter allowed ('z'); the first is 'a'.
  (global $last i32 (i32.const 122))
  (global $tokens (mut i32) (i32.const 0))
  (global $flags (mut i32) (i32.const 0))
  ;; The three masks (start, after a space, after a letter), $words u32 words each.
  (global $masks (mut i32) (i32.const 0))
  (global $words (mut i32) (i32.const 0))
  (global $history (mut i32) (i32.const 0))
  (global $len (mut i32) (i32.const 0))
  (global $cap i32 (i32.const 1048576))

  (func $alloc (export "host_alloc") (param $size i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (global.set $heap (i32.add (local.get $ptr) (local.get $size)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then
        (if (i32.lt_s (memory.grow (i32.add (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536))) (i32.const 65536)) (i32.const 1))) (i32.const 0))
          (then (return (i32.const 0))))))
    (local.get $ptr))

  ;; Whether byte $c may appear in the output.
  (func $word_byte (param $c i32) (result i32)
    (i32.or (i32.eq (local.get $c) (i32.const 32))
            (i32.and (i32.ge_u (local.get $c) (i32.const 97)) (i32.le_u (local.get $c) (global.get $last)))))

  ;; u32 count, u32 eos count, the eos ids, then per token a u32 length and its bytes.
  (func (export "constraint_vocab") (param $ptr i32) (param $len i32) (result i32)
    (local $end i32) (local $p i32) (local $n i32) (local $i i32) (local $l i32) (local $j i32)
    (local $f i32) (local $eos i32) (local $neos i32)
    (local.set $end (i32.add (local.get $ptr) (local.get $len)))
    (local.set $n (i32.load (local.get $ptr)))
    (local.set $neos (i32.load offset=4 (local.get $ptr)))
    (global.set $tokens (local.get $n))
    (global.set $flags (call $alloc (local.get $n)))
    (global.set $history (call $alloc (global.get $cap)))
    (global.set $words (i32.shr_u (i32.add (local.get $n) (i32.const 31)) (i32.const 5)))
    (global.set $masks (call $alloc (i32.mul (global.get $words) (i32.const 12))))
    (if (i32.or (i32.or (i32.eqz (global.get $flags)) (i32.eqz (global.get $history))) (i32.eqz (global.get $masks)))
      (then (return (i32.const 2))))
    (memory.fill (global.get $masks) (i32.const 0) (i32.mul (global.get $words) (i32.const 12)))
    (local.set $eos (i32.add (local.get $ptr) (i32.const 8)))
    (local.set $p (i32.add (local.get $eos) (i32.shl (local.get $neos) (i32.const 2))))
    (block $done
      (loop $token
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (if (i32.gt_u (i32.add (local.get $p) (i32.const 4)) (local.get $end))
          (then (call $log (i32.const 0) (i32.const 1024) (i32.const 27)) (return (i32.const 1))))
        (local.set $l (i32.load (local.get $p)))
        (local.set $p (i32.add (local.get $p) (i32.const 4)))
        (if (i32.gt_u (i32.add (local.get $p) (local.get $l)) (local.get $end))
          (then (call $log (i32.const 0) (i32.const 1024) (i32.const 27)) (return (i32.const 1))))
        (local.set $f (i32.ne (local.get $l) (i32.const 0)))
        (local.set $j (i32.const 0))
        (block $bytes_done
          (loop $bytes
            (br_if $bytes_done (i32.ge_u (local.get $j) (local.get $l)))
            (if (i32.eqz (call $word_byte (i32.load8_u (i32.add (local.get $p) (local.get $j)))))
              (then (local.set $f (i32.const 0))))
            (local.set $j (i32.add (local.get $j) (i32.const 1)))
            (br $bytes)))
        (if (local.get $f)
          (then
            (if (i32.eq (i32.load8_u (local.get $p)) (i32.const 32))
              (then (local.set $f (i32.or (local.get $f) (i32.const 2)))))
            (if (i32.eq (i32.load8_u (i32.sub (i32.add (local.get $p) (local.get $l)) (i32.const 1))) (i32.const 32))
              (then (local.set $f (i32.or (local.get $f) (i32.const 4)))))))
        (i32.store8 (i32.add (global.get $flags) (local.get $i)) (local.get $f))
        (local.set $p (i32.add (local.get $p) (local.get $l)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $token)))
    (local.set $i (i32.const 0))
    (block $eos_done
      (loop $eos_loop
        (br_if $eos_done (i32.ge_u (local.get $i) (local.get $neos)))
        (local.set $j (i32.load (i32.add (local.get $eos) (i32.shl (local.get $i) (i32.const 2)))))
        (if (i32.lt_u (local.get $j) (local.get $n))
          (then (i32.store8 (i32.add (global.get $flags) (local.get $j)) (i32.const 8))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $eos_loop)))
    (local.set $i (i32.const 0))
    (block $masks_done
      (loop $mask_loop
        (br_if $masks_done (i32.ge_u (local.get $i) (local.get $n)))
        (local.set $f (i32.load8_u (i32.add (global.get $flags) (local.get $i))))
        (if (i32.and (local.get $f) (i32.const 8))
          (then (call $set (i32.const 1) (local.get $i)) (call $set (i32.const 2) (local.get $i))))
        (if (i32.eq (i32.and (local.get $f) (i32.const 3)) (i32.const 1))
          (then (call $set (i32.const 0) (local.get $i)) (call $set (i32.const 1) (local.get $i))))
        (if (i32.and (local.get $f) (i32.const 1))
          (then (call $set (i32.const 2) (local.get $i))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $mask_loop)))
    (i32.const 0))

  ;; Sets token $t's bit in mask $m.
  (func $set (param $m i32) (param $t i32)
    (local $w i32)
    (local.set $w (i32.add (i32.add (global.get $masks) (i32.shl (i32.mul (local.get $m) (global.get $words)) (i32.const 2)))
                           (i32.shl (i32.shr_u (local.get $t) (i32.const 5)) (i32.const 2))))
    (i32.store (local.get $w) (i32.or (i32.load (local.get $w)) (i32.shl (i32.const 1) (i32.and (local.get $t) (i32.const 31))))))

  ;; A new request: nothing accepted yet.
  (func (export "host_begin") (param i32 i32 i64) (result i32)
    (global.set $len (i32.const 0))
    (i32.const 0))

  ;; The tokens allowed next: one of the three masks, copied into the host's buffer.
  (func (export "constraint_mask") (param $out i32) (param $words i32) (result i32)
    (local $m i32)
    (if (global.get $len)
      (then
        (local.set $m
          (if (result i32) (i32.and (i32.load8_u (i32.add (global.get $history) (i32.sub (global.get $len) (i32.const 1)))) (i32.const 4))
            (then (i32.const 1))
            (else (i32.const 2))))))
    (if (i32.gt_u (local.get $words) (global.get $words)) (then (local.set $words (global.get $words))))
    (memory.copy (local.get $out)
                 (i32.add (global.get $masks) (i32.shl (i32.mul (local.get $m) (global.get $words)) (i32.const 2)))
                 (i32.shl (local.get $words) (i32.const 2)))
    (i32.const 2))

  (func (export "constraint_accept") (param $token i32) (result i32)
    (if (i32.ge_u (global.get $len) (global.get $cap))
      (then (call $log (i32.const 0) (i32.const 1056) (i32.const 35)) (return (i32.const 1))))
    (if (i32.ge_u (local.get $token) (global.get $tokens)) (then (return (i32.const 1))))
    (i32.store8 (i32.add (global.get $history) (global.get $len))
                (i32.load8_u (i32.add (global.get $flags) (local.get $token))))
    (global.set $len (i32.add (global.get $len) (i32.const 1)))
    (i32.const 0))

  (func (export "constraint_rollback") (param $n i32) (result i32)
    (if (i32.gt_u (local.get $n) (global.get $len)) (then (return (i32.const 1))))
    (global.set $len (i32.sub (global.get $len) (local.get $n)))
    (i32.const 0)))
