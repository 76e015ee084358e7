#!/usr/bin/env python3
"""How much of the optimizer's update ran under backward, from an engine trace
(zoffload.trace_path; Chrome trace-event JSON).

Per step: the span of gradient hand-overs (GradientReady calls: the backward as the engine sees
it), the update time spent on the updater thread before the last hand-over and after it, how
long Step waited, the delay from each parameter's hand-over to the start of its update
(overlap "backward"), and how busy the Adam threads were after backward (every update, under
"none"); the Adam passes (one per chunk) under and after backward, and the updater's time
outside them (starting each chunk's upload; with NVMe state, waiting for a staging slot);
then, under backward, when the first update started, how long the updater stood idle between
updates, and the worker's time on norm parts (its check before each update).
For ZeRO (a "zero" track): per step, the time blocked in parameter gathers.
Usage: tools/trace_overlap.py TRACE.json
"""
import json
import statistics
import sys


def main(path):
    events = json.load(open(path))["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault(tracks[e["tid"]], []).append(e)
    for name in spans:
        spans[name].sort(key=lambda e: e["ts"])
    waits = [e for e in spans.get("engine", []) if e["name"] == "wait for gradients"]
    step_updates = [e for e in spans.get("engine", []) if e["name"] == "update"]
    handed = spans.get("gradients handed over", [])
    updates = spans.get("updates during backward", [])
    adam = [e for t, s in spans.items() if t.startswith("adam thread") for e in s]
    norms = spans.get("gradient norms as they land", [])
    passes = [e for e in spans.get("step", []) if e["name"].startswith("adam ")]
    print(f"{path}: {len(waits)} steps, {len(handed)} hand-overs, {len(updates)} updates "
          f"on the updater")
    begin = 0
    for k, wait in enumerate(waits):
        step_start = wait["ts"]
        h = [e for e in handed if begin <= e["ts"] < step_start]
        u = [e for e in updates if begin <= e["ts"] < step_start + wait["dur"]]
        if not h:
            begin = step_start + wait["dur"]
            continue
        first, last = h[0]["ts"], h[-1]["ts"] + h[-1]["dur"]
        before = sum(max(0, min(e["ts"] + e["dur"], last) - e["ts"]) for e in u) / 1e6
        after = sum(e["dur"] for e in u) / 1e6 - before
        start_of = {e["name"]: e["ts"] for e in u}
        delays = [(start_of[e["name"]] - (e["ts"] + e["dur"])) / 1e6 for e in h
                  if e["name"] in start_of]
        busy = sum(e["dur"] for e in adam if first <= e["ts"] < last) / 1e6
        # After backward the updates have the cores (under "none" all of them run then, in
        # Step's update): a slow step shows here as threads that took no tiles, or as busy time
        # spread over a longer wall time.
        update = next((e for e in step_updates if e["ts"] >= step_start), None)
        end = update["ts"] + update["dur"] if update else step_start + wait["dur"]
        tail = [e for e in adam if last <= e["ts"] < end]
        print(f"step {k + 1}: hand-overs over {(last - first) / 1e6:.3f} s, "
              f"{sum(e['dur'] for e in h) / 1e6:.3f} s in GradientReady; updates {before:.3f} s "
              f"before the last hand-over, {after:.3f} s after; Step waited "
              f"{wait['dur'] / 1e6:.3f} s; Adam threads busy {busy:.3f} thread-s during "
              f"backward" + (f"; hand-over to update start: median "
                             f"{statistics.median(delays):.3f} s, max {max(delays):.3f} s"
                             if delays else ""))
        wall = (max(e["ts"] + e["dur"] for e in tail) - min(e["ts"] for e in tail)) / 1e6 \
            if tail else 0
        if wall > 0:
            threads = len({e["tid"] for e in tail})
            tail_busy = sum(e["dur"] for e in tail) / 1e6
            print(f"  after backward: {threads} Adam threads busy {tail_busy:.3f} thread-s in "
                  f"{wall:.3f} s of updates ({tail_busy / (wall * threads):.0%} each)")
        # Each chunk is one pass of the Adam threads; between passes the updater starts the
        # chunk's upload (NVMe state: and takes the next staging slot), while the threads wait.
        p_under = [e for e in passes if first <= e["ts"] < last]
        p_after = [e for e in passes if last <= e["ts"] < end]
        if p_under or p_after:
            in_under = sum(e["dur"] for e in p_under) / 1e6
            in_after = sum(e["dur"] for e in p_after) / 1e6
            update_after = after if u else (update["dur"] / 1e6 if update else in_after)
            print(f"  Adam passes: {len(p_under)} under backward ({in_under:.3f} s), "
                  f"{len(p_after)} after ({in_after:.3f} s, mean "
                  f"{1e3 * in_after / max(1, len(p_after)):.2f} ms); the updater outside them "
                  f"{max(0.0, before - in_under):.3f} s under backward, "
                  f"{max(0.0, update_after - in_after):.3f} s after")
        under = [e for e in u if e["ts"] < last]
        if under:
            idle = (last - under[0]["ts"]) / 1e6 - before
            checked = sum(min(e["ts"] + e["dur"], last) - e["ts"]
                          for e in norms if first <= e["ts"] < last) / 1e6
            print(f"  under backward: first update {(under[0]['ts'] - first) / 1e6:.3f} s after "
                  f"the first hand-over, the updater idle {idle:.3f} s between updates, the "
                  f"worker {checked:.3f} s on norm parts")
        begin = step_start + wait["dur"]
    # ZeRO (zoffload.torch with offload_param nvme, or across ranks): per step, the time the
    # caller was blocked in parameter gathers, against the time between steps.
    begin = 0
    for k, step in enumerate(e for e in spans.get("zero", []) if e["name"] == "step"):
        g = [e for e in spans.get("parameter gathers", []) if begin <= e["ts"] < step["ts"]]
        if g:
            print(f"ZeRO step {k + 1}: {len(g)} gathers blocked {sum(e['dur'] for e in g) / 1e6:.3f}"
                  f" s of the {(step['ts'] - begin) / 1e6:.3f} s before the step; the step "
                  f"{step['dur'] / 1e6:.3f} s")
        begin = step["ts"] + step["dur"]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
