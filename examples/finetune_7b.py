"""Fully fine-tune a 7B Llama-shaped model on one 24 GiB GPU with zoffload, losslessly (fp32
master weights and Adam moments in host memory; bf16 weights on the GPU).

    python examples/finetune_7b.py                                # random init, seed 0, 6 steps
    python examples/finetune_7b.py --overlap delayed --state bf16
    python examples/finetune_7b.py --model PATH                   # real weights (transformers)
    python examples/finetune_7b.py --layers 16                    # 3.5B, the same shape otherwise
    python examples/finetune_7b.py --layers 60 --state int8 --offload-param   # ~12.5B: the
        # parameters stay in host memory and each layer is copied to the GPU when it runs
    python examples/finetune_7b.py --layers 64 --state int8 --offload-param --nvme /mnt/nvme \
        --nvme-ratio 0.2                                          # 13.2B: a fifth of the
        # optimizer state on NVMe (--param-nvme: the parameters' values there too)

The model: hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000 (Llama-2-7B's
shape, 6.74B parameters), bf16, gradient checkpointing, batch 4 x 2048 tokens (one fixed batch
of random tokens, seed 0, so runs compare step by step). The GPU is capped at --gpu-mem-cap
(torch's allocator gets the cap less the engine's own device memory). Each step prints its
time, tokens/s, loss, GPU peak and host RSS; --json writes them.

The training loop is plain PyTorch; zoffload takes the optimizer's place (OffloadOptimizer).
"""

import argparse
import json
import os
import resource
import time

import torch

GIB = 1 << 30


def add_model_args(ap):
    """The model, data and measurement options shared with bench/finetune_7b.py."""
    ap.add_argument("--model", default="", help="a transformers checkpoint (default: random init)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6, help="steps; the first 2 are warm-up")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--gpu-mem-cap", default="24GiB", help="GPU memory cap, or 'none'")
    ap.add_argument("--json", default="", help="write the per-step figures here")


def parse_bytes(text):
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def build_model(args):
    """The bf16 model on the GPU, built there directly (no fp32 copy anywhere). Real weights
    with --offload-param stay on the CPU: the optimizer takes them into host memory, then
    run_zoffload moves the (empty) model to the GPU. (Random init is made on the GPU in every
    case, so that every system starts from the same values.)"""
    import transformers

    torch.manual_seed(0)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, torch_dtype=torch.bfloat16)
        if not getattr(args, "offload_param", False):
            model = model.cuda()
    else:
        config = transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers,
            num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
            max_position_embeddings=args.seq, torch_dtype=torch.bfloat16)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config)
        torch.set_default_dtype(default)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    return model


def make_batch(args):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32000, (args.batch, args.seq), generator=g).cuda()


def cap_gpu(args, held_elsewhere=0):
    """Caps torch's allocator so that it and `held_elsewhere` bytes fit under the cap."""
    if args.gpu_mem_cap == "none":
        return None
    cap = parse_bytes(args.gpu_mem_cap)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((cap - held_elsewhere) / total)
    return cap


def host_rss_gib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


def timed_steps(rows):
    """The steps a system's s/step is taken over: from step 3 on (steps 1-2 warm up)."""
    return rows[2:] or rows


class Meter:
    """Per-step figures: time, tokens/s, loss, GPU peak (torch's + `extra_gpu`), host RSS."""

    def __init__(self, args, name, extra_gpu=0):
        self.args, self.name, self.extra_gpu = args, name, extra_gpu
        self.rows = []
        self.start = None

    def begin(self):
        torch.cuda.synchronize()
        self.start = time.perf_counter()

    def end(self, loss, **extra):
        torch.cuda.synchronize()
        seconds = time.perf_counter() - self.start
        tokens = self.args.batch * self.args.seq * self.args.accumulation
        row = {"step": len(self.rows) + 1, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "loss": loss, "gpu_peak_gib": (torch.cuda.max_memory_allocated()
                                              + self.extra_gpu) / GIB,
               "host_rss_gib": host_rss_gib(), **extra}
        self.rows.append(row)
        print(f"{self.name} step {row['step']}: {seconds:.3f} s  {row['tokens_per_s']:.0f} tok/s  "
              f"loss {loss:.4f}  GPU peak {row['gpu_peak_gib']:.1f} GiB  "
              f"host RSS {row['host_rss_gib']:.1f} GiB", flush=True)

    def summary(self, **extra):
        timed = timed_steps(self.rows)
        mean = sum(r["seconds"] for r in timed) / len(timed)
        out = {"system": self.name, "seconds_per_step": mean,
               "tokens_per_s": self.args.batch * self.args.seq * self.args.accumulation / mean,
               "losses": [r["loss"] for r in self.rows],
               "gpu_peak_gib": max(r["gpu_peak_gib"] for r in self.rows),
               "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
               "steps": self.rows, **extra}
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(out, f, indent=1)
        return out


def forward_backward(model, tokens, accumulation):
    """One step's forward and backward passes; the mean loss, as a GPU tensor. Reading it
    (.item()) waits for the GPU, with torch's default a thread spinning on a core: the caller
    reads it after the optimizer step, so that nothing spins while the update runs under
    backward."""
    total = None
    for _ in range(accumulation):
        loss = model(input_ids=tokens, labels=tokens).loss / accumulation
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def zoffload_config(args):
    nvme = getattr(args, "nvme", "")
    state = {"device": "cpu", "pin_memory": True}
    if nvme and getattr(args, "nvme_ratio", 0) > 0:
        state = {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                 "ratio": args.nvme_ratio}
    zero = {"stage": 2, "reduce_bucket_size": 50_000_000, "offload_optimizer": state}
    if getattr(args, "offload_param", False):
        values = {"device": "cpu", "pin_memory": True}
        if nvme and getattr(args, "param_nvme", False):
            values = {"device": "nvme", "nvme_path": nvme, "pin_memory": True}
        zero.update(stage=3, offload_param=values)
        if getattr(args, "prefetch_elements", None) is not None:
            zero["stage3_prefetch_bucket_size"] = args.prefetch_elements
    # Undeclared: the loop's repeated backward adds up as torch's .grad does (overlap none).
    declared = ({"gradient_accumulation_steps": args.accumulation}
                if getattr(args, "declare_accumulation", True) else {})
    return {
        **declared,
        "activation_checkpointing": {
            "cpu_checkpointing": getattr(args, "cpu_checkpointing", False)},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "zoffload": {"overlap": args.overlap, "optimizer_state": args.state,
                     "delayed_warmup_steps": 1, "cpu_adam_threads": args.threads,
                     "update_chunk_elements": getattr(args, "chunk", "0"),
                     "trace_path": getattr(args, "trace", "")},
    }


def measure(args, name, model, tokens, step, extra_gpu=0):
    """args.steps steps of forward and backward, then `step()` (the optimizer's part; it may
    return more figures for the step's row)."""
    torch.cuda.reset_peak_memory_stats()
    meter = Meter(args, name, extra_gpu)
    for _ in range(args.steps):
        meter.begin()
        loss = forward_backward(model, tokens, args.accumulation)
        extra = step() or {}
        meter.end(loss.item(), **extra)
    return meter


def run_zoffload(args, name=""):
    import zoffload.torch

    model = build_model(args)
    tokens = make_batch(args)
    opt = zoffload.torch.OffloadOptimizer(model.named_parameters(), config=zoffload_config(args),
                                          model=model)
    model.cuda()  # its buffers; with --offload-param the parameters are empty until used
    torch.cuda.empty_cache()  # with --offload-param the parameters have left the GPU
    # (Parameters on NVMe: ZeRO in one process, whose buffers are in host memory.)
    gpu_bytes = opt.engine.gpu_bytes if opt.zero is None else 0
    cap_gpu(args, held_elsewhere=gpu_bytes)

    clip = getattr(args, "clip", 0.0)

    def step():
        if clip > 0:  # as torch loops clip: after backward, before the step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        s = opt.stats()
        # With --offload-param also the parameter copies' GPU time and the part of it that the
        # compute waited for; under overlap "backward" how the step's update ran.
        return {k: s[k] for k in ("adam_seconds", "wait_grads_seconds", "update_seconds",
                                  "grad_norm", "clip_coef", "upload_wait_seconds",
                                  "parameter_copy_seconds", "parameter_copy_exposed_seconds",
                                  "speculation", "speculation_why", "speculated_elements",
                                  "activations_offloaded", "activations_prefetched",
                                  "activation_host_bytes", "activation_copy_seconds",
                                  "activation_copy_exposed_seconds")
                if k in s}

    default_name = f"zoffload:{args.overlap}:{args.state}" + (
        ":params" if getattr(args, "offload_param", False) else "")
    meter = measure(args, name or default_name, model, tokens, step, extra_gpu=gpu_bytes)
    opt.flush()
    meter.host_bytes = opt.engine.host_bytes if opt.zero is None else None
    return meter


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--cpu-checkpointing", action="store_true",
                    help="the checkpointed layers' inputs in host memory "
                         "(activation_checkpointing.cpu_checkpointing)")
    ap.add_argument("--overlap", default="none", choices=["none", "backward", "delayed", "auto"])
    ap.add_argument("--state", default="fp32", choices=["fp32", "bf16", "int8"],
                    help="precision of Adam's moments (the masters are fp32 always)")
    ap.add_argument("--threads", type=int, default=0, help="CPU Adam threads (0: physical cores)")
    ap.add_argument("--chunk", default="0",
                    help="elements per chunk of the CPU update, e.g. 16M (zoffload."
                         "update_chunk_elements; 0: the default)")
    ap.add_argument("--trace", default="",
                    help="write the engine's timeline here (Perfetto; tools/trace_overlap.py)")
    ap.add_argument("--offload-param", action="store_true",
                    help="ZeRO stage 3 with offload_param cpu: the parameters live in host "
                         "memory and each layer is copied to the GPU when it runs")
    ap.add_argument("--nvme", default="", metavar="DIR",
                    help="a directory on NVMe for what --nvme-ratio and --param-nvme put there")
    ap.add_argument("--nvme-ratio", type=float, default=1.0,
                    help="with --nvme: the share of the optimizer state on NVMe (the rest in "
                         "host memory); 0: none")
    ap.add_argument("--clip", type=float, default=0.0, metavar="MAX_NORM",
                    help="clip in the loop, torch's way: torch.nn.utils.clip_grad_norm_ before "
                         "each step (0: no clipping)")
    ap.add_argument("--undeclared-accumulation", dest="declare_accumulation",
                    action="store_false",
                    help="leave gradient_accumulation_steps out of the config: the loop's "
                         "backward passes add up as torch's .grad (overlap none)")
    ap.add_argument("--param-nvme", action="store_true",
                    help="with --nvme and --offload-param: the parameters' values on NVMe too "
                         "(offload_param nvme), read ahead of use into a host cache")
    args = ap.parse_args()
    if (args.param_nvme or args.nvme_ratio != 1.0) and not args.nvme:
        ap.error("--nvme-ratio and --param-nvme need --nvme DIR")
    if args.param_nvme and not args.offload_param:
        ap.error("--param-nvme needs --offload-param")
    meter = run_zoffload(args)
    meter.summary(host_bytes=meter.host_bytes)


if __name__ == "__main__":
    main()
