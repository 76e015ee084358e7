"""What overlap "backward"'s speculation costs the CPU update: host-mode steps (no GPU needed)
of one optimizer over TENSORS tensors of ELEMENTS fp32 elements each, in one process, as

  none         the exact step after backward (the anchor),
  backward     updates during backward with the state kept aside (the second set of buffers
               that lets a step be redone; zoffload.rollback_bytes default),
  backward:0   the same with no room for the sets (zoffload.rollback_bytes 0: from the second
               step the updates run without one),

and prints each one's best step time of steps 3+ and its ratio to none's. In host mode the
"backward" is torch's autograd on the CPU handing over gradients, so the update does not
overlap anything here: the figure is the update's own cost.

usage: bench/speculation_overhead.py [--tensors 8] [--elements 24000000] [--steps 6]
"""
import argparse
import time

import torch

import zoffload.torch as zt


def run(overlap, rollback, args):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.elements)) for _ in range(args.tensors)]
    grads = [torch.randn(args.elements) * 0.01 for _ in range(args.tensors)]
    zoffload = {"overlap": overlap}
    if rollback is not None:
        zoffload["rollback_bytes"] = rollback
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "zoffload": zoffload}
    opt = zt.OffloadOptimizer([(f"p{i}", p) for i, p in enumerate(params)], config, lr=1e-3)
    times = []
    for _ in range(args.steps):
        loss = sum((p * g).sum() for p, g in zip(params, grads))
        start = time.perf_counter()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    stats = opt.stats()
    opt.close()
    return min(times[2:]), stats["speculation"], stats["speculated_elements"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--elements", type=int, default=24_000_000)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    anchor = None
    print(f"{args.tensors} x {args.elements} fp32 elements, best step of steps 3-{args.steps}")
    for name, overlap, rollback in (("none", "none", None), ("backward", "backward", None),
                                    ("backward:0", "backward", 0)):
        seconds, kind, speculated = run(overlap, rollback, args)
        anchor = anchor or seconds
        print(f"{name:11s} {seconds:.3f} s/step  {seconds / anchor:.3f} x none  "
              f"({kind or 'exact'}, {speculated} elements updated during backward)")


if __name__ == "__main__":
    main()
