#!/usr/bin/env python3
"""Plots of zoffload-bench's JSON (needs matplotlib): one PNG per input file.

  bench/plot.py [--out DIR] FILE.json ...

- nvme: a heatmap of GB/s over block size x queue depth per operation (the best thread count
  of each cell), the recommended setting (the one of the printed aio block) outlined;
- adam: Gparam/s per layout against the bandwidth ceiling on the same buffers, noisy figures
  hatched;
- step, engine: the measured step against its bounds (a timeline summary);
- pcie, kernels: GB/s per test against its anchor.
The kind comes from the records' "profile"; the PNG is named after the input.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def short_size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024


def plot_nvme(records, ax_for):
    ops = sorted({r["op"] for r in records})
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.2), squeeze=False)
    blocks = sorted({r["block_size"] for r in records})
    depths = sorted({r["queue_depth"] for r in records})
    for ax, op in zip(axes[0], ops):
        grid = [[0.0] * len(blocks) for _ in depths]
        best_threads = [[0] * len(blocks) for _ in depths]
        marked = None
        for r in records:
            if r["op"] != op:
                continue
            i, j = depths.index(r["queue_depth"]), blocks.index(r["block_size"])
            if r["GBps"] > grid[i][j]:
                grid[i][j], best_threads[i][j] = r["GBps"], r["threads"]
            if r.get("recommended"):
                marked = (i, j)
        image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(blocks)):
                ax.text(j, i, f"{grid[i][j]:.2f}\n{best_threads[i][j]} thr", ha="center",
                        va="center", color="white", fontsize=7)
        if marked:
            i, j = marked
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red",
                                       linewidth=2.5))
        ax.set_xticks(range(len(blocks)), [short_size(b) for b in blocks])
        ax.set_yticks(range(len(depths)), [str(d) for d in depths])
        ax.set_xlabel("block size")
        ax.set_ylabel("queue depth")
        title = f"NVMe {op}, GB/s"
        ax.set_title(title + (" (red: recommended)" if marked else ""))
        fig.colorbar(image, ax=ax)
    return fig


def plot_adam(records, ax_for):
    fig, ax = ax_for(max(6, 1.3 * len(records)))
    labels = [f"{r['rule']}\ng {r['grad_dtype']}\ns {r['state']}\nc {r['param_copy']}"
              for r in records]
    xs = range(len(records))
    adam = [r["Gparams_per_s"] for r in records]
    ceiling = [r["params"] / r["ceiling_seconds"] / 1e9 for r in records]
    bars = ax.bar([x - 0.2 for x in xs], adam, width=0.4, label="CPU Adam")
    ax.bar([x + 0.2 for x in xs], ceiling, width=0.4, label="bandwidth ceiling", color="lightgray")
    for bar, r in zip(bars, records):
        if r.get("noisy"):
            bar.set_hatch("//")
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{r['bandwidth_ratio']:.2f}" + (" noisy" if r.get("noisy") else ""),
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("Gparam/s")
    r0 = records[0]
    ax.set_title(f"CPU Adam, {r0['params'] / 2**20:.0f}M params, {r0['threads']} threads, "
                 f"{r0.get('target', '')} (label: ratio to the ceiling)")
    ax.legend()
    return fig


def plot_bounds(records, ax_for):
    rows = []
    for r in records:
        if r["profile"] == "step":
            rows += [("step", r["step_seconds"]), ("I/O bound (disk, mixed)", r["io_bound_seconds"]),
                     ("I/O serial (read, then write)", r["io_serial_seconds"]),
                     ("I/O-only pass (our pipeline)", r["io_pass_seconds"]),
                     ("CPU Adam alone", r["adam_bound_seconds"])]
            title = (f"step: {r['params'] / 2**20:.0f}M params, {r['state']} state on "
                     f"{r['state_on']}")
        else:
            rows += [("step", r["step_seconds"]), ("bound", r["bound_seconds"]),
                     ("gradients alone", r["grad_alone_seconds"]),
                     ("gradients in host memory", r["grads_seconds"]),
                     ("CPU Adam alone", r["adam_alone_seconds"])]
            title = (f"engine ({r['mode']} mode, overlap {r.get('overlap', 'none')}): "
                     f"{r['params'] / 1e9:.2f}B params, state on {r['state_on']}")
        break  # one record per file
    fig, ax = ax_for(7)
    names = [n for n, _ in rows][::-1]
    values = [v for _, v in rows][::-1]
    colors = ["tab:blue" if n == "step" else "lightgray" for n in names]
    ax.barh(names, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.3f} s", va="center", fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    return fig


def plot_gpu(records, ax_for):
    fig, ax = ax_for(7)
    names = [r["test"] for r in records]
    ax.barh(names, [r["GBps"] for r in records], height=0.4, label="zoffload")
    ax.barh([i + 0.4 for i in range(len(records))], [r["anchor_GBps"] for r in records],
            height=0.4, color="lightgray", label="anchor")
    ax.set_xlabel("GB/s")
    ax.set_title(f"{records[0]['profile']}: zoffload against its anchor")
    ax.legend()
    return fig


PLOTS = {"nvme": plot_nvme, "adam": plot_adam, "step": plot_bounds, "engine": plot_bounds,
         "pcie": plot_gpu, "kernels": plot_gpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="JSON written by zoffload-bench PROFILE --json")
    ap.add_argument("--out", default=".", help="directory for the PNGs (default: .)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    for path in args.files:
        try:
            with open(path) as f:
                records = json.load(f)
            profile = records[0]["profile"]
            plot = PLOTS[profile]
        except (OSError, ValueError, LookupError, TypeError) as e:
            print(f"{path}: not zoffload-bench JSON ({e})", file=sys.stderr)
            failed += 1
            continue

        def ax_for(width):
            fig, ax = plt.subplots(figsize=(width, 4.2))
            return fig, ax

        fig = plot(records, ax_for)
        fig.tight_layout()
        out = os.path.join(args.out, os.path.splitext(os.path.basename(path))[0] + ".png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        print(f"wrote {out} ({profile})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
