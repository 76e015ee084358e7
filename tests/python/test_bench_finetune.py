"""bench/finetune_7b.py's report on the systems of a recorded H200 run (docs/perf): the table,
each mode's ratio to its bound, the comparisons, the JSON and the plots."""

import importlib.util
import json
import os
import pathlib
import types

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(os.environ.get("ZO_SOURCE_DIR", pathlib.Path(__file__).parents[2]))


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "finetune_bench", ROOT / "bench" / "finetune_7b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_gives_each_mode_its_bound(tmp_path, capsys):
    bench = load_bench()
    results = json.loads((ROOT / "docs" / "perf" / "finetune_7b_h200_run4.json").read_text())
    args = types.SimpleNamespace(out=str(tmp_path), layers=32)
    bench.report(args, results["results"])
    out = capsys.readouterr().out
    # fwd 0.234, fwd_bwd 0.881, CPU Adam 1.393 (inside the exact step): backward's bound is
    # 0.234 + max(0.647, 1.393) = 1.627 s.
    assert ("bounds, fp32 state: fwd+bwd 0.881 s, CPU Adam 1.393 s: none 2.274 s, delayed "
            "1.393 s, backward 1.627 s") in out
    assert "zoffload:none:fp32: 2.318 s/step = 1.02 x its bound (2.274 s" in out
    # Steps 3-5 of backward: 1.947, 1.921, 1.924 s; the median step 1.924 = 1.18 x.
    assert ("zoffload:backward:fp32: 1.931 s/step = 1.19 x its bound (1.627 s; median step "
            "1.18 x") in out
    assert "| zoffload:backward:fp32 | 1.931 | 1.924 |" in out
    assert "zoffload:backward:fp32:t13: 2.117 s/step = 1.30 x" in out
    written = json.loads((tmp_path / "finetune_7b.json").read_text())
    assert written["bounds"]["fp32"]["backward"] == pytest.approx(1.627, abs=1e-3)
    for png in ("finetune_7b_loss.png", "finetune_7b_step.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")


def test_system_names_carry_thread_counts_and_chunks(monkeypatch):
    bench = load_bench()
    args = types.SimpleNamespace(trace=False, json="x.json")
    seen = {}
    # Only the parsing of the name is under test here: the run itself is recorded, not made.
    monkeypatch.setattr(bench.ft, "run_zoffload", lambda a, name: seen.update(
        threads=a.threads, chunk=a.chunk, overlap=a.overlap, state=a.state, name=name))
    bench.run_zoffload(args, "zoffload:backward:fp32:t13:c16M")
    assert seen == {"threads": 13, "chunk": "16M", "overlap": "backward", "state": "fp32",
                    "name": "zoffload:backward:fp32:t13:c16M"}
    bench.run_zoffload(args, "zoffload:none:int8")
    assert seen["threads"] == 0 and seen["chunk"] == "0" and seen["state"] == "int8"
