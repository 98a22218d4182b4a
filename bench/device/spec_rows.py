"""Markdown rows of `host bench --batch --speculative --json` output: spec_rows.py FILE LABEL."""
import json
import sys

for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['model']} | {sys.argv[2]} | {r['batch']} | {r['plain_decode_tps']:.1f} | {r['decode_tps']:.1f} "
          f"| {r['vs_plain']:.2f}x | {r['verifications']}/{r['steps']} | {r['draft_tokens']} |")
