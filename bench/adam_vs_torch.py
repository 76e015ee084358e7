#!/usr/bin/env python3
"""CPU Adam: zoffload against torch's fused CPU AdamW, same machine, threads and run.

Anchors (torch, fp32 params and state, N parameters in one tensor, median of STEPS steps):
  torch fused AdamW               torch.optim.AdamW(fused=True)   (28 B/param)
  torch fused AdamW + bf16 cast   the same step, then param.to(bfloat16) into a preallocated
                                  tensor: the offload layout done the usual way (two passes)
zoffload (zoffload-bench adam --json): fp32 grads/state (vs the first anchor) and bf16 grads +
fp32 state + bf16 param copy in one pass (vs the second).

usage: bench/adam_vs_torch.py [--params 256M] [--threads N] [--steps 5] [--build build/default]
                              [--json FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def torch_anchor(n, threads, steps, cast):
    import torch
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.rand(n, dtype=torch.float32) + 0.5)
    p.grad = (torch.rand(n, dtype=torch.float32) - 0.5) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    out = torch.empty(n, dtype=torch.bfloat16)
    opt.step()  # warm-up (allocates the state)
    if cast:
        out.copy_(p.detach())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        if cast:
            out.copy_(p.detach())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="256M")
    ap.add_argument("--threads", type=int, default=0, help="0: zoffload's default (physical cores)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--build", default="build/default")
    ap.add_argument("--json")
    args = ap.parse_args()
    n = parse_count(args.params)
    out = f"/tmp/zoffload-adam-{os.getpid()}.json"
    cmd = [os.path.join(args.build, "tools/zoffload-bench"), "adam", "--params", str(n),
           "--steps", str(args.steps), "--grad-dtype", "fp32,bf16", "--state", "fp32,bf16,int8",
           "--param-copy", "none,bf16", "--json", out]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"zoffload-bench failed:\n{proc.stdout}\n{proc.stderr}")
    print(proc.stdout)
    with open(out) as f:
        records = json.load(f)
    os.unlink(out)
    threads = records[0]["threads"]
    t_plain = torch_anchor(n, threads, args.steps, cast=False)
    t_cast = torch_anchor(n, threads, args.steps, cast=True)

    def find(g, s, c):
        return next(r for r in records if (r["grad_dtype"], r["state"], r["param_copy"]) == (g, s, c))

    rows = []
    fp32 = find("fp32", "fp32", "none")
    offload = find("bf16", "fp32", "bf16")
    rows.append(("fp32 grads, fp32 state", fp32, "torch fused AdamW", t_plain))
    rows.append(("bf16 grads, fp32 state, bf16 copy", offload, "torch fused AdamW + bf16 cast", t_cast))
    print(f"{n} params, {threads} threads (torch.set_num_threads), median of {args.steps} steps")
    print(f"{'zoffload path':36} {'Gparam/s':>9} {'anchor':>32} {'Gparam/s':>9} {'ratio':>6}")
    result = []
    for name, rec, anchor, t in rows:
        ratio = t / rec["seconds_per_step"]
        print(f"{name:36} {rec['Gparams_per_s']:9.3f} {anchor:>32} {n / t / 1e9:9.3f} {ratio:6.2f}")
        result.append({"zoffload": name, "Gparams_per_s": rec["Gparams_per_s"], "anchor": anchor,
                       "anchor_Gparams_per_s": n / t / 1e9, "ratio": ratio})
    int8 = find("bf16", "int8", "bf16")
    print(f"int8 state vs fp32 state (both bf16 grads + bf16 copy): "
          f"{offload['seconds_per_step'] / int8['seconds_per_step']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"comparisons": result, "zoffload_records": records}, f, indent=2)


if __name__ == "__main__":
    main()
