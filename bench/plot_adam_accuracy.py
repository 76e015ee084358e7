#!/usr/bin/env python3
"""Plots the loss curves written by `adam_accuracy --csv FILE` (needs matplotlib).

  build/default/bench/adam_accuracy --csv acc.csv && python3 bench/plot_adam_accuracy.py acc.csv docs/cpu_adam_accuracy.png
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: plot_adam_accuracy.py CSV PNG")
    with open(argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    fig, (loss, ratio) = plt.subplots(1, 2, figsize=(10, 4))
    for state, color in (("fp32", "tab:blue"), ("bf16", "tab:orange"), ("int8", "tab:green")):
        values = [float(r[state]) for r in rows]
        loss.plot(steps, values, marker=".", color=color, label=f"{state} state")
        if state != "fp32":
            ratio.plot(steps, [v / float(r["fp32"]) for v, r in zip(values, rows)], marker=".",
                       color=color, label=f"{state} / fp32")
    loss.set_yscale("log")
    loss.set_xlabel("step")
    loss.set_ylabel("training loss (MSE)")
    loss.set_title("MLP 32-64-1, AdamW")
    loss.legend()
    ratio.axhline(1.0, color="gray", linewidth=0.8)
    ratio.set_xlabel("step")
    ratio.set_ylabel("loss / fp32-state loss")
    ratio.set_title("relative to fp32 state")
    ratio.legend()
    fig.tight_layout()
    fig.savefig(argv[2], dpi=100)


if __name__ == "__main__":
    main(sys.argv)
