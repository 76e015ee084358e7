#!/usr/bin/env python3
"""CPU Adam: zoffload against torch's fused CPU AdamW and DeepSpeed's cpu_adam, same machine,
threads and run.

Anchors (fp32 params and state, N parameters in one tensor, median of STEPS steps):
  torch fused AdamW               torch.optim.AdamW(fused=True)   (28 B/param)
  torch fused AdamW + bf16 cast   the same step, then param.to(bfloat16) into a preallocated
                                  tensor: the offload layout done the usual way (two passes)
  DeepSpeed cpu_adam (+ bf16 cast)  deepspeed.ops.adam.DeepSpeedCPUAdam (AdamW mode), the same
                                  two ways; measured when deepspeed is importable (its op is
                                  compiled on first use), skipped with a note otherwise
zoffload (zoffload-bench adam --json): fp32 grads/state (vs the plain anchors) and bf16 grads +
fp32 state + bf16 param copy in one pass (vs the cast anchors). Each round runs zoffload and the
anchors in fresh processes back to back; the ratio is the median over rounds of the per-round
ratios.

usage: bench/adam_vs_torch.py [--params 256M] [--threads N] [--steps 5] [--rounds 3]
                              [--build build/default] [--json FILE]
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


def anchor_seconds(make_optimizer, n, steps, cast):
    import torch
    p = torch.nn.Parameter(torch.rand(n, dtype=torch.float32) + 0.5)
    p.grad = (torch.rand(n, dtype=torch.float32) - 0.5) * 1e-2
    opt = make_optimizer(p)
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


def anchors(n, threads, steps):
    """Seconds per step of every anchor available here; DeepSpeed's only if it imports."""
    import torch
    torch.set_num_threads(threads)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def torch_adamw(p):
        return torch.optim.AdamW([p], fused=True, **hyper)

    result = {key: anchor_seconds(torch_adamw, n, steps, cast) for key, cast in
              (("plain", False), ("cast", True))}
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:
        result["deepspeed_missing"] = str(e)
        return result

    def deepspeed_adamw(p):
        return DeepSpeedCPUAdam([p], adamw_mode=True, **hyper)

    for key, cast in (("ds_plain", False), ("ds_cast", True)):
        result[key] = anchor_seconds(deepspeed_adamw, n, steps, cast)
    return result


def run_json(cmd, env=None):
    """The command's last line of output (DeepSpeed logs to stdout when it loads)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="256M")
    ap.add_argument("--threads", type=int, default=0, help="0: zoffload's default (physical cores)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build", default="build/default")
    ap.add_argument("--json")
    ap.add_argument("--anchors", nargs=3, type=int, metavar=("N", "THREADS", "STEPS"),
                    help=argparse.SUPPRESS)  # internal: one round of the anchors in a fresh process
    args = ap.parse_args()
    if args.anchors:
        n, threads, steps = args.anchors
        print(json.dumps(anchors(n, threads, steps)))
        return
    n = parse_count(args.params)
    out = f"/tmp/zoffload-adam-{os.getpid()}.json"
    cmd = [os.path.join(args.build, "tools/zoffload-bench"), "adam", "--params", str(n),
           "--steps", str(args.steps), "--grad-dtype", "fp32,bf16", "--state", "fp32",
           "--param-copy", "none,bf16", "--json", out]
    if args.threads:
        cmd += ["--threads", str(args.threads)]

    def find(records, g, c):
        return next(r for r in records if (r["grad_dtype"], r["param_copy"]) == (g, c))

    # Memory bandwidth differs from process to process on these machines: every round runs
    # zoffload and the anchors in fresh processes back to back, and ratios are taken per round.
    paths = [("fp32 grads, fp32 state", "fp32", "none", "torch fused AdamW", "plain"),
             ("bf16 grads, fp32 state, bf16 copy", "bf16", "bf16", "torch fused AdamW + bf16 cast",
              "cast"),
             ("fp32 grads, fp32 state", "fp32", "none", "DeepSpeed cpu_adam", "ds_plain"),
             ("bf16 grads, fp32 state, bf16 copy", "bf16", "bf16", "DeepSpeed cpu_adam + bf16 cast",
              "ds_cast")]
    rounds = []
    for r in range(args.rounds):
        run_json(cmd)
        with open(out) as f:
            records = json.load(f)
        os.unlink(out)
        threads = records[0]["threads"]
        # DeepSpeed's op has its own OpenMP runtime: the thread count goes through the environment.
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        seconds = json.loads(run_json([sys.executable, os.path.abspath(__file__), "--anchors",
                                       str(n), str(threads), str(args.steps)], env))
        if r == 0:  # the anchors this machine has
            if "deepspeed_missing" in seconds:
                print(f"DeepSpeed anchors skipped: {seconds['deepspeed_missing']}", flush=True)
            paths = [path for path in paths if path[4] in seconds]
        row = []
        for name, g, c, anchor, key in paths:
            rec = find(records, g, c)
            row.append({"zoffload": name, "Gparams_per_s": rec["Gparams_per_s"], "anchor": anchor,
                        "anchor_Gparams_per_s": n / seconds[key] / 1e9,
                        "ratio": seconds[key] / rec["seconds_per_step"]})
            print(f"round {r + 1}: {name}: {rec['Gparams_per_s']:.3f} Gparam/s, {anchor} "
                  f"{n / seconds[key] / 1e9:.3f}, ratio {row[-1]['ratio']:.3f}", flush=True)
        rounds.append(row)
    print(f"{n} params, {threads} threads (torch.set_num_threads, OMP_NUM_THREADS), median of "
          f"{args.steps} steps, {args.rounds} rounds")
    print(f"{'zoffload path':36} {'Gparam/s':>9} {'anchor':>32} {'Gparam/s':>9} {'ratio':>6}")
    result = []
    for i, (name, _, _, anchor, _) in enumerate(paths):
        ours = statistics.median(rd[i]["Gparams_per_s"] for rd in rounds)
        theirs = statistics.median(rd[i]["anchor_Gparams_per_s"] for rd in rounds)
        ratio = statistics.median(rd[i]["ratio"] for rd in rounds)
        print(f"{name:36} {ours:9.3f} {anchor:>32} {theirs:9.3f} {ratio:6.2f}")
        result.append({"zoffload": name, "Gparams_per_s": ours, "anchor": anchor,
                       "anchor_Gparams_per_s": theirs, "ratio": ratio,
                       "ratios_per_round": [rd[i]["ratio"] for rd in rounds]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"comparisons": result, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
