"""bench/plot.py on recorded zoffload-bench JSON (docs/perf): one non-empty PNG per profile."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

ROOT = pathlib.Path(os.environ.get("ZO_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
RECORDED = ["nvme_sweep_dev2core", "adam_paths_h200_round1", "step_nvme_12GiB_h200",
            "engine_7b_h200", "pcie_h200", "gpu_kernels_h200"]


def test_every_profile_plots(tmp_path):
    files = [str(ROOT / "docs" / "perf" / f"{name}.json") for name in RECORDED]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), "--out", str(tmp_path),
                        *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in RECORDED:
        png = tmp_path / f"{name}.png"
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name


def test_a_file_that_is_not_bench_json_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), "--out", str(tmp_path),
                        str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "bad.json: not zoffload-bench JSON" in r.stderr
