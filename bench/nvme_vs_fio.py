#!/usr/bin/env python3
"""zoffload-bench nvme against its anchors on the same file, in the same run.

For each block size: ROUNDS alternating rounds of
  zoffload-bench nvme (write then read, O_DIRECT, registered buffers),
  fio (ioengine=io_uring, direct=1, numjobs=1; plain and with fixedbufs+registerfiles) if installed,
  raw_uring_loop (bench/raw_uring_loop.cc: the smallest io_uring loop),
all on one file of SIZE bytes, same block size and queue depth, one thread. Prints the median
GB/s of each and zoffload's ratio to the best anchor (the median of the per-round ratios, which
cancels the disk's drift between rounds); --json writes every measurement.

usage: bench/nvme_vs_fio.py [--dir DIR] [--size 4GiB] [--block-sizes 1M,4M] [--queue-depth 32]
                            [--rounds 3] [--build build/default] [--json FILE]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text):
    t = text.upper().rstrip("B").rstrip("I")
    unit = t[-1] if t and t[-1] in UNITS else ""
    return int(t[: len(t) - len(unit)]) * UNITS[unit]


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def zoffload(args, path, bs, op):
    out = os.path.join(args.dir, "zoffload-nvme-records.json")
    run([os.path.join(args.build, "tools/zoffload-bench"), "nvme", "--path", args.dir,
         "--file", os.path.basename(path), "--overwrite", "--size", str(args.size), "--block-size", str(bs),
         "--queue-depth", str(args.queue_depth), "--threads", "1", "--op", op, "--json", out])
    with open(out) as f:
        records = json.load(f)
    os.unlink(out)
    if not all(r["direct"] for r in records):
        sys.exit("zoffload-bench could not use O_DIRECT here: no disk speed to compare")
    return records[0]["GBps"]


def fio(args, path, bs, op, fixed):
    cmd = ["fio", "--name=anchor", f"--filename={path}", f"--size={args.size}", f"--bs={bs}",
           f"--iodepth={args.queue_depth}", "--ioengine=io_uring", "--direct=1", f"--rw={op}",
           "--numjobs=1", "--output-format=json"]
    if fixed:
        cmd += ["--fixedbufs", "--registerfiles"]
    result = json.loads(run(cmd))["jobs"][0]
    return result["read" if op == "read" else "write"]["bw_bytes"] / 1e9


def raw_loop(args, path, bs, op):
    out = run([os.path.join(args.build, "bench/raw_uring_loop"), path, str(args.size), str(bs),
               str(args.queue_depth), op])
    return json.loads(out)["GBps"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".")
    p.add_argument("--size", default="4GiB")
    p.add_argument("--block-sizes", default="1M,4M")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--build", default="build/default")
    p.add_argument("--json")
    args = p.parse_args()
    args.size = parse_size(args.size)
    have_fio = shutil.which("fio") is not None
    path = os.path.join(args.dir, f"zoffload-nvme-cmp-{os.getpid()}.dat")
    # Written once in full first (zoffload-bench lays out a --file that does not exist yet).
    measurements = []
    rows = []
    try:
        for bs_text in args.block_sizes.split(","):
            bs = parse_size(bs_text)
            samples = {}
            tools = ["zoffload", "raw io_uring loop"] + (["fio", "fio fixedbufs"] if have_fio else [])
            runners = {
                "zoffload": lambda op: zoffload(args, path, bs, op),
                "raw io_uring loop": lambda op: raw_loop(args, path, bs, op),
                "fio": lambda op: fio(args, path, bs, op, fixed=False),
                "fio fixedbufs": lambda op: fio(args, path, bs, op, fixed=True),
            }
            for r in range(args.rounds):
                # Every tool writes the whole file, then every tool reads it; the order rotates
                # each round so no tool always runs first (or right after its own write).
                order = tools[r % len(tools):] + tools[:r % len(tools)]
                got = {}
                for op in ("write", "read"):
                    for tool in order:
                        got[(tool, op)] = runners[tool](op)
                for (tool, op), gbps in got.items():
                    samples.setdefault((tool, op), []).append(gbps)
                    measurements.append({"round": r, "tool": tool, "op": op, "block_size": bs,
                                         "queue_depth": args.queue_depth, "bytes": args.size,
                                         "GBps": gbps})
                print(f"bs {bs_text} round {r + 1}/{args.rounds}: " +
                      ", ".join(f"{t} {o} {v:.3f}" for (t, o), v in got.items()), file=sys.stderr)
            for op in ("write", "read"):
                med = {tool: statistics.median(v) for (tool, o), v in samples.items() if o == op}
                anchors = {t: v for t, v in med.items() if t != "zoffload"}
                best_tool = max(anchors, key=anchors.get)
                # The ratio is the median of per-round ratios: runs of one round are adjacent in
                # time, so the disk's drift (host caches, other tenants) cancels out.
                paired = statistics.median(
                    z / a for z, a in zip(samples[("zoffload", op)], samples[(best_tool, op)]))
                rows.append((op, bs_text, med["zoffload"], best_tool, anchors[best_tool], paired, med))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(f"\nsize {args.size} bytes, queue depth {args.queue_depth}, 1 thread, O_DIRECT, "
          f"median of {args.rounds} alternating rounds (GB/s = 1e9 B/s)")
    print(f"{'op':6} {'block':>6} {'zoffload':>9} {'best anchor':>24} {'ratio':>7}   all anchors"
          "   (ratio: median of per-round zoffload/anchor)")
    for op, bs, z, tool, anchor, ratio, med in rows:
        others = ", ".join(f"{t} {v:.3f}" for t, v in med.items() if t != "zoffload")
        print(f"{op:6} {bs:>6} {z:9.3f} {tool:>17} {anchor:6.3f} {ratio:7.3f}   {others}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{"op": r[0], "block": r[1], "zoffload_GBps": r[2], "anchor": r[3],
                                 "anchor_GBps": r[4], "ratio": r[5]} for r in rows],
                       "measurements": measurements}, f, indent=2)


if __name__ == "__main__":
    main()
