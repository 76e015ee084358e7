"""What a user can do to the Python API that must not lose files or crash the process: save
targets that exist, tensors whose memory changes or goes, special files where a path is read,
edited checkpoint state, values that would change meaning, and the import order with torch."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import zoffload
import zoffload.torch as zt

CONFIG = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def trained(steps=2, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = zt.OffloadOptimizer(model.named_parameters(), CONFIG, lr=1e-2)
    for _ in range(steps):
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def tree(path):
    """Every file under path with its bytes."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


# ---- 1. save targets ----------------------------------------------------------------------

def test_save_refuses_targets_holding_other_files_and_keeps_them(tmp_path):
    _, opt = trained()
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "tokenizer.json").write_text("t")
    (proj / "sub" / "weights.bin").write_bytes(b"\x01\x02")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"precious")
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    before = tree(tmp_path)
    for target in (proj, str(proj) + "/", weights, tmp_path / "link", tmp_path):
        with pytest.raises(zoffload.AlreadyExists, match="never removes other files"):
            opt.save(target)
    assert tree(tmp_path) == before
    assert weights.is_file()
    # An empty directory and zoffload's own checkpoint are replaced.
    (tmp_path / "empty").mkdir()
    opt.save(tmp_path / "empty")
    opt.save(tmp_path / "empty")
    assert sorted(os.listdir(tmp_path / "empty")) == ["manifest.json", "state.bin"]


def test_a_killed_saves_debris_goes_with_the_next_save_relative_paths_too(tmp_path, monkeypatch):
    _, opt = trained()
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = int(child.stdout)  # a pid that has exited
    debris = tmp_path / f"ck.tmp-{dead}"
    debris.mkdir()
    (debris / "state.bin").write_bytes(b"partial")
    monkeypatch.chdir(tmp_path)
    opt.save("ck")
    assert not debris.exists()
    assert (tmp_path / "ck" / "manifest.json").is_file()


# ---- 2. tensor lifetimes ----------------------------------------------------------------------

def test_parameters_given_other_memory_are_refused_by_name_not_a_crash():
    for change, moved in (("assign", r"0\.weight"), ("share_memory", r"\d\.(weight|bias)")):
        model, opt = trained(steps=1)
        if change == "assign":
            model[0].weight.data = model[0].weight.data.clone()
        else:
            model.share_memory()
        with pytest.raises(zoffload.FailedPrecondition, match=f"'{moved}'.*other memory"):
            model(torch.randn(5, 8)).square().sum().backward()  # the hook sees it
        with pytest.raises(zoffload.FailedPrecondition, match=f"'{moved}'.*other memory"):
            opt.step()  # and so does step(), for a loop that hands gradients over itself
        opt.close()


def test_the_engine_keeps_what_it_writes_into_alive():
    params = [("w", np.ones(1000, np.float32), 0)]
    e = zoffload.Engine(zoffload.load_config(CONFIG), params, [{"lr": 0.1}])
    del params  # the caller's last reference to the array
    for _ in range(3):
        e.gradient_ready("w", np.full(1000, 0.5, np.float32), 0)
        e.step()
    master, _, _ = e.read_state("w")
    assert np.all(master < 1)
    buffer = e.gradient_buffer("w")
    e.close()
    if buffer is not None:  # the engine's own memory: still valid after close()
        buffer[:] = 7
    for call in (lambda: e.step(), lambda: e.gradient_buffer("w"), lambda: e.read_state("w"),
                 lambda: e.gradient_ready("w", np.zeros(1000, np.float32), 0)):
        with pytest.raises(zoffload.FailedPrecondition, match="closed"):
            call()


def test_a_closed_optimizer_refuses_every_call():
    model, opt = trained(steps=1)
    opt.close()
    for call in (opt.step, lambda: opt.save("/tmp/never"), opt.state_dict):
        with pytest.raises(zoffload.FailedPrecondition):
            call()


# ---- 3. special files and unbounded input --------------------------------------------------

def test_special_files_are_refused_unread_wherever_a_path_is_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_text(" " * (17 << 20) + "{}")
    for path in ("/dev/zero", str(fifo), str(tmp_path), str(big)):
        done = []
        worker = threading.Thread(target=lambda p=path: done.append(_config_error(p)))
        worker.start()
        worker.join(timeout=20)
        assert done, f"load_config({path}) hung"
        assert path in done[0]
    _, opt = trained()
    ck = tmp_path / "ck"
    opt.save(ck)
    os.remove(ck / "manifest.json")
    os.symlink("/dev/zero", ck / "manifest.json")
    with pytest.raises(zoffload.InvalidArgument, match="not a regular file"):
        opt.load(ck)
    with pytest.raises(zoffload.InvalidArgument, match="not a regular file"):
        zoffload.export_safetensors(str(ck), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()


def _config_error(path):
    try:
        zoffload.load_config(path)
    except zoffload.ConfigError as e:
        return str(e)
    return ""


# ---- 5. checkpoint metadata -----------------------------------------------------------------

def test_an_edited_manifest_does_not_load(tmp_path):
    model, opt = trained()
    opt.save(tmp_path / "ck")
    manifest = tmp_path / "ck" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"lr": 0.01', '"lr": -1', 1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(zoffload.DataLoss, match="checksum"):
        opt.load(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_load_state_dict_checks_dtypes_and_shapes():
    _, opt = trained()
    state = opt.state_dict()
    name = next(iter(state["state"]))
    good = state["state"][name]
    for key, bad in (("exp_avg", good["exp_avg"].double()[: good["exp_avg"].numel() // 2]),
                     ("exp_avg_sq", good["exp_avg_sq"].view(torch.int32)),
                     ("master", good["master"].double()[: good["master"].numel() // 2])):
        edited = {**state, "state": {**state["state"], name: {**good, key: bad}}}
        with pytest.raises(zoffload.InvalidArgument, match=name.replace(".", r"\.")):
            opt.load_state_dict(edited)
    opt.load_state_dict(state)  # the real one still loads


# ---- 7. one parser; values that would change meaning ---------------------------------------

@pytest.mark.parametrize("text, where", [
    ('{"optimizer": {"params": {"lr": 1e-400}}}', "optimizer.params.lr"),
    ('{"gradient_clipping": 1.0, "gradient_clipping": 2.0}', "gradient_clipping"),
    ('{"zero_optimization": {"reduce_bucket_size": 9007199254740993.0}}', "reduce_bucket_size"),
    ('\ufeff{"train_batch_size": 18446744073709551616}', "train_batch_size"),
    ('{"a": ' * 5000 + '1' + '}' * 5000, "nested deeper"),
])
def test_python_parses_configs_as_cpp_does(tmp_path, text, where):
    path = tmp_path / "c.json"
    path.write_text(text, encoding="utf-8")
    for source in (text, str(path)):
        with pytest.raises(zoffload.ConfigError, match=where):
            zoffload.load_config(source)


def test_a_nan_gradient_reports_a_nan_norm():
    model, opt = trained(steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.full((5, 8), float("nan"))).sum().backward()
    opt.step()
    stats = opt.stats()
    assert stats["skipped"]
    assert stats["grad_norm"] != stats["grad_norm"]  # NaN, not 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---- 8. import order ---------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["import zoffload, torch", "import torch, zoffload"])
def test_both_import_orders_work(order):
    code = (f"{order}\n"
            "import zoffload.torch\n"
            "m = torch.nn.Linear(4, 2)\n"
            "opt = zoffload.torch.OffloadOptimizer(m.named_parameters(), lr=0.1)\n"
            "m(torch.ones(3, 4)).sum().backward(); opt.step(); print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=os.environ.copy())
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
