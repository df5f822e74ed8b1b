#!/usr/bin/env python3
"""How often a client edits an earlier part of its conversations, from `dsx serve` logs.

Each finished request logs one JSON line; a request that continued a resident session
carries `prev_prompt` (that session's previous prompt length in tokens) and `prev_common`
(how many of those tokens the new prompt shares). A request is counted as

  continuation  prev_common >= half of prev_prompt (the same conversation; below that
                the session was only the nearest one, another conversation's),
  edit          a continuation with prev_common < prev_prompt: something before the end
                of the previous prompt changed; its depth is prev_prompt - prev_common
                tokens, and it is an early-block edit when the change lies before the
                last whole block (--block tokens, the disk cache's 2048) of the prompt.

usage: tools/log_edits.py [--block N] LOG [LOG ...]   (non-JSON lines are skipped)
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--block", type=int, default=2048)
    a = ap.parse_args()
    reqs = cont = edits = early = 0
    depths = []
    lost = 0
    shared = 0
    for path in a.logs:
        with open(path, errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    j = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "tokens_in" not in j:
                    continue
                reqs += 1
                pp, pc = j.get("prev_prompt", -1), j.get("prev_common", -1)
                if pp <= 0 or 2 * pc < pp:
                    continue
                cont += 1
                shared += pp
                if pc < pp:
                    edits += 1
                    depths.append(pp - pc)
                    lost += pp - pc
                    if pc < (pp // a.block) * a.block:
                        early += 1
    print(f"requests {reqs}")
    print(f"continuations {cont}")
    print(f"edits {edits}" + (f" ({100.0 * edits / cont:.1f} % of continuations)" if cont else ""))
    print(f"early_block_edits {early}" + (f" ({100.0 * early / cont:.1f} %)" if cont else ""))
    if depths:
        depths.sort()
        print(f"edit_depth_tokens median {depths[len(depths) // 2]} max {depths[-1]}")
    if shared:
        print(f"previous_prompt_tokens_lost {lost} of {shared} ({100.0 * lost / shared:.2f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
