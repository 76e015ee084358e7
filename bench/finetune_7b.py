#!/usr/bin/env python3
"""7B on one 24 GiB GPU, side by side: each system trains the same Llama-shaped model
(examples/finetune_7b.py: random init seed 0, bf16, gradient checkpointing, 4 x 2048 tokens)
in its own process, with the same data and GPU cap; this prints s/step, tokens/s, the losses,
GPU peak and host memory, the ratios to the bounds and anchors, and writes JSON and plots.

Systems (--systems, comma-separated; default: all):
  fwd            forward alone (no graph kept): overlap "backward"'s bound is fwd + max(the
                 rest of fwd_bwd, CPU Adam)
  fwd_bwd        forward and backward alone, hooks dropping each gradient (the GPU's part)
  no_offload     everything in HBM, no cap: bf16 model, fp32 masters + torch fused AdamW on the
                 GPU (the speed of light)
  manual         the hand-written torch offload loop: post-accumulate hooks into pinned host
                 buffers, torch fused CPU AdamW per parameter, bf16 copy back
  torchao        torchao CPUOffloadOptimizer(AdamW fused, offload_gradients) on the bf16 model:
                 no fp32 master (labelled so: not lossless)
  deepspeed_z2   DeepSpeed ZeRO-2 + offload_optimizer cpu (pin_memory, overlap_comm)
  deepspeed_z3   DeepSpeed ZeRO-3 + offload_param/offload_optimizer cpu, zero.Init
  zoffload:OVERLAP:STATE[:tN][:cN][:clipN][:undecl][:actoff][:params[:nopf][:pnvme]][:nvmeR]   e.g. zoffload:none:fp32,
                 zoffload:delayed:bf16; tN: N CPU Adam threads (default: all cores, one fewer
                 with overlap); cN: N elements per chunk of the CPU update (e.g. c16M;
                 zoffload.update_chunk_elements); params: stage 3 with offload_param cpu (the
                 parameters in host memory, fetched per module: models bigger than the GPU);
                 nopf: without prefetch (each module's copy starts at its use: the fetch time
                 that prefetch hides); pnvme: the parameters' values on NVMe (offload_param
                 nvme); nvmeR: the share R of the optimizer state on NVMe (e.g. nvme0.2). NVMe
                 is --nvme-dir. clipN: the loop clips as torch loops do,
                 torch.nn.utils.clip_grad_norm_(model.parameters(), N) before each step (e.g.
                 clip1.0), instead of nothing. undecl: the config leaves
                 gradient_accumulation_steps out; the --accumulation backward passes add up as
                 torch's .grad does (overlap none). actoff: the checkpointed layers' inputs
                 in host memory (activation_checkpointing.cpu_checkpointing).
A system that fails (out of memory, killed, import error) is a result: its exit status and
the last lines it printed are recorded.

usage: bench/finetune_7b.py [--systems ...] [--layers 32] [--steps 6] [--out DIR]
       bench/finetune_7b.py --system NAME [model options]    (one system, this process)
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import finetune_7b as ft  # noqa: E402

ALL = ["fwd", "fwd_bwd", "no_offload", "zoffload:none:fp32", "zoffload:backward:fp32",
       "zoffload:delayed:fp32", "zoffload:delayed:bf16", "manual", "torchao", "deepspeed_z2",
       "deepspeed_z3"]


def run_fwd(args, torch):
    model = ft.build_model(args)
    tokens = ft.make_batch(args)
    ft.cap_gpu(args)
    meter = ft.Meter(args, "fwd")
    for _ in range(args.steps):
        meter.begin()
        with torch.no_grad():
            total = sum(model(input_ids=tokens, labels=tokens).loss.item()
                        for _ in range(args.accumulation))
        meter.end(total / args.accumulation)
    return meter


def run_fwd_bwd(args, torch):
    model = ft.build_model(args)
    tokens = ft.make_batch(args)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
    ft.cap_gpu(args)
    return ft.measure(args, "fwd_bwd", model, tokens, lambda: None)


def run_no_offload(args, torch):
    args.gpu_mem_cap = "none"
    model = ft.build_model(args)
    tokens = ft.make_batch(args)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, lr=args.lr, weight_decay=0.0, fused=True)

    @torch.no_grad()
    def step():
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        for m, p in zip(masters, params):
            m.grad = None
            p.copy_(m)

    return ft.measure(args, "no_offload", model, tokens, step)


def run_manual(args, torch):
    """What a careful user writes without a library."""
    model = ft.build_model(args)
    tokens = ft.make_batch(args)
    params = list(model.parameters())
    masters = [p.detach().float().cpu() for p in params]
    pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
    opts = [torch.optim.AdamW([m], lr=args.lr, weight_decay=0.0, fused=True) for m in masters]
    side = torch.cuda.Stream()
    first = [True]

    def hook(i):
        def f(t):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if first[0]:
                    pinned[i].copy_(t.grad, non_blocking=True)
                else:
                    pinned[i].add_(t.grad.cpu())  # accumulation: rare path
                t.grad.record_stream(side)
            t.grad = None
        return f

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(hook(i))
    ft.cap_gpu(args)

    @torch.no_grad()
    def step():
        side.synchronize()
        for m, g, p, o in zip(masters, pinned, params, opts):
            m.grad = g.float()
            o.step()
            m.grad = None
            g.copy_(m)  # the bf16 copy, pinned, goes up
            p.copy_(g, non_blocking=True)

    return ft.measure(args, "manual", model, tokens, step)


def run_torchao(args, torch):
    from torchao.optim import CPUOffloadOptimizer

    model = ft.build_model(args)
    tokens = ft.make_batch(args)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True,
                              fused=True, lr=args.lr, weight_decay=0.0)
    ft.cap_gpu(args)

    def step():
        opt.step()
        opt.zero_grad()

    return ft.measure(args, "torchao (bf16 params, no fp32 master)", model, tokens, step)


def run_deepspeed(args, torch, stage):
    import deepspeed

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "reduce_bucket_size": 2e8}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    else:
        zero["allgather_bucket_size"] = 2e8
    config = {"train_micro_batch_size_per_gpu": args.batch,
              "gradient_accumulation_steps": args.accumulation, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
              "zero_optimization": zero}
    ft.cap_gpu(args)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = ft.build_model(args)
    else:
        model = ft.build_model(args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    tokens = ft.make_batch(args)
    torch.cuda.reset_peak_memory_stats()
    meter = ft.Meter(args, f"deepspeed_z{stage}")
    for _ in range(args.steps):
        meter.begin()
        total = 0.0
        for _ in range(args.accumulation):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / args.accumulation
        meter.end(total)
    return meter


def run_zoffload(args, name):
    # With overlap the update shares the CPU with the loop that launches the GPU's work: one
    # core is left to it.
    _, args.overlap, args.state, *rest = name.split(":")
    args.offload_param = "params" in rest
    args.prefetch_elements = 0 if "nopf" in rest else None
    args.param_nvme = "pnvme" in rest
    ratio = [r for r in rest if r.startswith("nvme")]
    args.nvme_ratio = float(ratio[0][4:]) if ratio else 0.0
    args.nvme = ""
    if args.param_nvme or args.nvme_ratio > 0:
        args.nvme = os.path.join(os.path.abspath(args.nvme_dir), name.replace(":", "_"))
        os.makedirs(args.nvme, exist_ok=True)
    threads = [r for r in rest if r.startswith("t")]
    if threads:
        args.threads = int(threads[0].lstrip("t"))
    else:
        args.threads = 0 if args.overlap == "none" else max(1, (os.cpu_count() or 2) - 1)
    clip = [r for r in rest if r.startswith("clip")]
    args.clip = float(clip[0][4:]) if clip else 0.0
    args.declare_accumulation = "undecl" not in rest
    args.cpu_checkpointing = "actoff" in rest
    chunk = [r for r in rest if r.startswith("c") and not r.startswith("clip")]
    args.chunk = chunk[0][1:] if chunk else "0"
    args.trace = os.path.join(os.path.dirname(os.path.abspath(args.json)),
                              name.replace(":", "_") + "_trace.json") if args.trace else ""
    return ft.run_zoffload(args, name)


def run_one(args):
    import torch

    name = args.system
    if name.startswith("zoffload:"):
        meter = run_zoffload(args, name)
    elif name.startswith("deepspeed_z"):
        meter = run_deepspeed(args, torch, int(name[-1]))
    else:
        meter = {"fwd": run_fwd, "fwd_bwd": run_fwd_bwd, "no_offload": run_no_offload,
                 "manual": run_manual, "torchao": run_torchao}[name](args, torch)
    meter.summary(params=ft_params(args), host_bytes=getattr(meter, "host_bytes", None))


def ft_params(args):
    """Parameters of the Llama shape at args.layers (embedding and head untied)."""
    h, i, v = 4096, 11008, 32000
    return 2 * v * h + args.layers * (4 * h * h + 3 * h * i + 2 * h) + h


def drive(args):
    os.makedirs(args.out, exist_ok=True)
    results = []
    for name in args.systems.split(","):
        path = os.path.join(args.out, name.replace(":", "_") + ".json")
        cmd = [sys.executable, os.path.abspath(__file__), "--system", name, "--json", path,
               "--layers", str(args.layers), "--steps", str(args.steps), "--batch",
               str(args.batch), "--seq", str(args.seq), "--accumulation", str(args.accumulation),
               "--gpu-mem-cap", args.gpu_mem_cap, "--lr", str(args.lr),
               "--nvme-dir", args.nvme_dir] + \
            (["--trace"] if args.trace else [])
        print(f"== {name}", flush=True)
        start = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code = "timeout"
            output = (e.stdout or b"").decode() + (e.stderr or b"").decode() \
                if isinstance(e.stdout, bytes) else str(e.stdout or "") + str(e.stderr or "")
        for line in output.splitlines():
            if " step " in line:
                print("  " + line, flush=True)
        if code == 0 and os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        else:
            tail = [l for l in output.splitlines() if l.strip()][-6:]
            result = {"system": name, "failed": True, "exit": code, "why": tail}
            print(f"  FAILED ({code}): " + " | ".join(tail)[-600:], flush=True)
        result["wall_seconds"] = time.time() - start
        # The system's NVMe files (a killed run leaves them).
        shutil.rmtree(os.path.join(args.nvme_dir, name.replace(":", "_")), ignore_errors=True)
        results.append(result)
    report(args, results)


def median_step(r):
    """The median of the steps the mean is taken over: one slow step shows."""
    return statistics.median(s["seconds"] for s in ft.timed_steps(r["steps"]))


def report(args, results):
    by = {r["system"].split(" ")[0]: r for r in results if not r.get("failed")}
    lines = ["| system | s/step | median | tok/s | GPU peak GiB | host GiB | losses |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['system']} | failed ({r['exit']}) | | | | | {' / '.join(r['why'][-2:])[:160]} |")
            continue
        losses = ", ".join(f"{x:.3f}" for x in r["losses"][:4])
        lines.append(f"| {r['system']} | {r['seconds_per_step']:.3f} | "
                     f"{median_step(r):.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['gpu_peak_gib']:.1f} | {r['host_peak_gib']:.1f} | {losses} |")
    print("\n".join(lines))
    # Parameter and activation offload: how much of their copies the compute did not wait for.
    for what in ("parameter", "activation"):
        for r in results:
            timed = [s for s in ft.timed_steps(r.get("steps", []))
                     if s.get(f"{what}_copy_seconds")]
            if timed:
                copy = sum(s[f"{what}_copy_seconds"] for s in timed) / len(timed)
                exposed = sum(s[f"{what}_copy_exposed_seconds"] for s in timed) / len(timed)
                print(f"| {r['system']} {what} copies: {copy:.3f} s of GPU time a step, the "
                      f"compute waited {exposed:.3f} s: {1 - exposed / copy:.0%} hidden |")
    for r in results:  # overlap "backward": the steps by how their update ran
        kinds = {}
        for s in ft.timed_steps(r.get("steps", [])):
            if s.get("speculation"):
                kinds.setdefault(s["speculation"], []).append(s["seconds"])
        if kinds:
            mix = ", ".join(f"{k} {len(v)} ({sum(v) / len(v):.3f} s/step)"
                            for k, v in sorted(kinds.items()))
            print(f"| {r['system']} speculation, steps 3+: {mix} |")
    bounds = precision_bounds(by)
    for name in ("manual", "torchao", "no_offload", "deepspeed_z2"):
        for mine in [k for k in by if k.startswith("zoffload:")]:
            if name in by:
                print(f"{mine} vs {name}: {by[name]['seconds_per_step'] / by[mine]['seconds_per_step']:.2f}x "
                      f"the speed ({by[mine]['tokens_per_s']:.0f} vs {by[name]['tokens_per_s']:.0f} tok/s)")
    with open(os.path.join(args.out, "finetune_7b.json"), "w") as f:
        json.dump({"layers": args.layers, "params": ft_params(args), "bounds": bounds,
                   "results": results}, f, indent=1)
    with open(os.path.join(args.out, "finetune_7b.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(args, results)


def precision_bounds(by):
    """Each state precision's bounds, from this call's runs: fwd_bwd and fwd give the GPU's
    forward + backward and forward; zoffload:none:STATE gives CPU Adam's time for that state.
    none: fwd + bwd + Adam; backward: fwd + max(bwd, Adam); delayed: max(fwd + bwd, Adam).
    Prints every zoffload system's ratio to its mode's bound for its precision."""
    fb, fwd = by.get("fwd_bwd"), by.get("fwd")
    if not fb:
        return {}
    fwd_bwd = fb["seconds_per_step"]
    bounds = {"fwd_bwd": fwd_bwd}
    for state in ("fp32", "bf16", "int8"):
        exact = by.get(f"zoffload:none:{state}")
        if not exact:
            continue
        timed = ft.timed_steps(exact["steps"])
        adam = sum(s["adam_seconds"] for s in timed) / len(timed)
        b = {"cpu_adam": adam, "none": fwd_bwd + adam, "delayed": max(fwd_bwd, adam)}
        if fwd:
            f = fwd["seconds_per_step"]
            b["backward"] = f + max(fwd_bwd - f, adam)
        bounds[state] = b
        print(f"bounds, {state} state: fwd+bwd {fwd_bwd:.3f} s, CPU Adam {adam:.3f} s: "
              + ", ".join(f"{mode} {v:.3f} s" for mode, v in b.items() if mode != "cpu_adam"))
        for name in [k for k in by if k.startswith("zoffload:") and k.split(":")[2] == state]:
            mode = name.split(":")[1]
            mode = "backward" if mode == "auto" else mode
            if mode not in b:
                continue
            r = by[name]
            print(f"{name}: {r['seconds_per_step']:.3f} s/step = "
                  f"{r['seconds_per_step'] / b[mode]:.2f} x its bound ({b[mode]:.3f} s; median "
                  f"step {median_step(r) / b[mode]:.2f} x; target <= 1.1)")
    return bounds


def plot(args, results):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots")
        return
    ok = [r for r in results if not r.get("failed")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in ok:
        if r["system"] not in ("fwd", "fwd_bwd"):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", label=r["system"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"Llama shape, {ft_params(args) / 1e9:.2f}B params, 4 x 2048 tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "finetune_7b_loss.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["system"] for r in ok]
    bars = ax.bar(range(len(ok)), [r["seconds_per_step"] for r in ok])
    for b, r in zip(bars, ok):
        ax.annotate(f"GPU {r['gpu_peak_gib']:.1f}\nhost {r['host_peak_gib']:.0f} GiB",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=6)
    ax.set_xticks(range(len(ok)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("s/step")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "finetune_7b_step.png"), dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ft.add_model_args(ap)
    ap.add_argument("--system", default="", help="run this one system here")
    ap.add_argument("--systems", default=",".join(ALL))
    ap.add_argument("--out", default="finetune_7b_out")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per system")
    ap.add_argument("--nvme-dir", default=".",
                    help="where systems with pnvme or nvmeR keep their files (a directory each)")
    ap.add_argument("--trace", action="store_true",
                    help="write each zoffload system's timeline to OUT/SYSTEM_trace.json")
    args = ap.parse_args()
    if args.system:
        run_one(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
