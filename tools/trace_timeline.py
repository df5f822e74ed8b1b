#!/usr/bin/env python3
"""Prints the kernel timeline written by DSX_TRACE=file (builds with -DDSX_KERNEL_TRACE=ON).

Each record is one kernel launch that called dev::pdl_wait: thread 0 of block 0 noted when
it reached the wait ("wait at") and when the wait returned ("done", i.e. when the previous
kernel of its stream had completed), in microseconds from the first record shown. "step" is
the time since the previous record's "done": along one stream it is the previous kernel's
time on the critical path. Marks (dev::trace_mark) print their tag, their time and the time
since the last "done". Per-block marks (dev::trace_block: every block of a launch records
its time and SM) are left out, or with --blocks summarized per launch and tag (blocks,
first / median / last time): a late last block is one that waited for an SM.
Usage: trace_timeline.py FILE [--last N] [--blocks]
"""
import struct
import sys


def block_summaries(per_block):
    """One record per (launch, tag) of dev::trace_block marks: the marks of one tag and grid
    within 25 us of the first make a launch."""
    groups = []
    open_ = {}
    for r in sorted(per_block, key=lambda r: r[1]):
        key = (r[2], r[3] & 0xffff)
        g = open_.get(key)
        if g is None or r[1] - g[0] > 25000:
            g = [r[1]]
            open_[key] = g
            groups.append((key, g))
        g.append(r[1])
    out = []
    for (grid, tag), g in groups:
        t = sorted(g[1:])
        out.append(((tag, len(t), t[0], t[len(t) // 2]), t[-1], grid, 0xFFFFFFFF))
    return out


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    last = 400
    blocks = "--blocks" in args
    if blocks:
        args.remove("--blocks")
    if "--last" in args:
        i = args.index("--last")
        last = int(args[i + 1])
        del args[i:i + 2]
    data = open(args[0], "rb").read()
    rec = 24
    n = struct.unpack_from("<I", data, 0)[0]
    cap = (len(data) - 4) // rec
    if cap <= 0:
        sys.exit("trace_timeline: no records in " + args[0])
    count = min(n, cap)
    recs = [struct.unpack_from("<QQII", data, 4 + rec * (i % cap)) for i in range(n - count, n)]
    per_block = [r for r in recs if (r[3] & 0xC0000000) == 0xC0000000]
    recs = [r for r in recs if (r[3] & 0xC0000000) != 0xC0000000]
    if blocks:
        recs += block_summaries(per_block)
    recs.sort(key=lambda r: r[1])
    recs = recs[-last:]
    if not recs:
        return
    t0 = recs[0][1]
    prev = t0
    print("  grid (x x y)  block    wait at      done     step   (us)")
    for t_wait, t_done, grid, block in recs:
        if block == 0xFFFFFFFF:  # a launch's per-block marks (block_summaries)
            tag, nb, first, med = t_wait
            print(f"{grid & 0xffff:6d} x {grid >> 16:<4d}  blocks tag {tag:<4d} n {nb:<4d} first {(first - t0) / 1e3:9.2f}"
                  f"  median {(med - t0) / 1e3:9.2f}  last {(t_done - t0) / 1e3:9.2f}")
            continue
        if block & 0x80000000:  # dev::trace_mark
            print(f"{grid & 0xffff:6d} x {grid >> 16:<4d}  mark {block & 0xffff:<4d}{(t_done - t0) / 1e3:19.2f}"
                  f" {(t_done - prev) / 1e3:8.2f}")
            continue
        print(f"{grid & 0xffff:6d} x {grid >> 16:<4d} {block:5d} {(t_wait - t0) / 1e3:10.2f} {(t_done - t0) / 1e3:9.2f}"
              f" {(t_done - prev) / 1e3:8.2f}")
        prev = t_done


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # (piped into head)
        pass
