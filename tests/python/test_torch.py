"""zoffload.torch.OffloadOptimizer in host-only mode (CPU), against torch.optim.AdamW and the
C++ engine on the same gradients; then every bad input the module must refuse cleanly."""

import json
import math

import numpy as np
import pytest
import torch

import zoffload
import zoffload.torch as zt

VOCAB, DIM, SEQ, BATCH = 97, 48, 12, 6


class TinyLM(torch.nn.Module):
    """An embedding, Linear + LayerNorm blocks and a tied output layer (odd sizes)."""

    def __init__(self, blocks=3):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.LayerNorm(DIM), torch.nn.GELU())
            for _ in range(blocks)
        )
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = h + b(h)
        return self.norm(h) @ self.embed.weight.t()  # tied output


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyLM()


def batches(steps, micro=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(micro)]
            for _ in range(steps)]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def groups_of(model, decay):
    """torch-style groups: no weight decay for norms and biases."""
    named = list(model.named_parameters())
    return [
        {"params": [(n, p) for n, p in named if p.ndim >= 2], "weight_decay": decay},
        {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def plain(groups):
    return [{**g, "params": [p for _, p in g["params"]]} for g in groups]


def config(**extra):
    c = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    c.update(extra)
    return c


def train(model, opt, data, scheduler=None, clip=0.0, reference=False):
    losses = []
    for micro_batches in data:
        total = 0.0
        for tokens in micro_batches:
            loss = loss_of(model, tokens)
            loss.backward()
            total += loss.item()
        if reference and clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / len(micro_batches))
    return losses


def assert_curves_match(ours, ref, rel=1e-4):
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= rel * abs(b), f"step {i}: {a} vs torch's {b}\nours {ours}\nref  {ref}"
    assert ours[-1] < ours[0], "the loss did not fall"


@pytest.mark.parametrize(
    "case",
    ["plain", "groups_and_schedule", "accumulation", "clipping"],
)
def test_loss_curve_matches_torch_adamw(case):
    steps, micro, clip, extra = 20, 1, 0.0, {}
    if case == "accumulation":
        micro = 4
        extra = {"gradient_accumulation_steps": 4}
    if case == "clipping":
        clip = 0.05  # small enough to clip on most steps
        extra = {"gradient_clipping": clip}
    data = batches(steps, micro)
    ours_model, ref_model = make_model(), make_model()
    lr = 3e-3
    if case == "groups_and_schedule":
        ours = zt.OffloadOptimizer(groups_of(ours_model, 0.1), config(**extra), lr=lr)
        ref = torch.optim.AdamW(plain(groups_of(ref_model, 0.1)), lr=lr)
        sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.2 * s))
                 for o in (ours, ref)]
    else:
        ours = zt.OffloadOptimizer(ours_model.named_parameters(), config(**extra), lr=lr,
                                   weight_decay=0.01)
        ref = torch.optim.AdamW(ref_model.parameters(), lr=lr, weight_decay=0.01)
        sched = [None, None]
    a = train(ours_model, ours, data, sched[0])
    b = train(ref_model, ref, data, sched[1], clip=clip, reference=True)
    assert_curves_match(a, b)
    if case == "groups_and_schedule":
        # The engine took each step's scheduled lr (the last step's: lr / (1 + 0.2 * 19)).
        assert ours.engine.group(0)["lr"] == pytest.approx(lr / (1 + 0.2 * (steps - 1)))
    assert ours.stats()["step"] == steps
    ours.close()


def test_parameters_equal_the_cpp_engine_on_the_same_gradients():
    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = []  # per step: name -> gradient, taken before the optimizer's hook drops it
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: grads[-1].__setitem__(n, p.grad.detach().clone()))
    cfg = config(gradient_clipping=1.0)
    opt = zt.OffloadOptimizer(model.named_parameters(), cfg, lr=1e-2, weight_decay=0.05)
    for micro_batches in batches(20):
        grads.append({})
        loss_of(model, micro_batches[0]).backward()
        opt.step()
    # The same gradients straight into a C++ engine over numpy arrays.
    arrays = {n: t.numpy().copy() for n, t in initial.items()}
    engine = zoffload.Engine(
        zoffload.load_config(cfg, lr=1e-2, weight_decay=0.05),
        [(n, a, 0) for n, a in arrays.items()],
        [{"lr": 1e-2, "weight_decay": 0.05}],
    )
    for step in grads:
        for k, (n, g) in enumerate(step.items()):
            buffer = engine.gradient_buffer(n)
            assert buffer.dtype == np.uint8 and buffer.nbytes == g.numel() * 4, n
            if k % 2 == 0:  # every other one written into the engine's memory, taken in place
                in_place = buffer.view(np.float32).reshape(g.shape)
                in_place[...] = g.numpy()
                engine.gradient_ready(n, in_place)
            else:
                engine.gradient_ready(n, g.numpy())
        engine.step()
    # Where the engine cannot take a gradient in place (the running update reads the last).
    delayed = zoffload.Engine(zoffload.load_config(config(zoffload={"overlap": "delayed"})),
                              [(n, a.copy(), 0) for n, a in arrays.items()], [{}])
    assert delayed.gradient_buffer("embed.weight") is None
    with pytest.raises(zoffload.NotFound):
        delayed.gradient_buffer("nope")
    delayed.close()
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), arrays[n], err_msg=n)
        master, m, v = engine.read_state(n)
        np.testing.assert_array_equal(master, arrays[n].ravel(), err_msg=n)
        assert m.dtype == np.float32 and v.dtype == np.float32 and np.all(v >= 0)


def test_one_rank_zero_offers_its_gradient_memory(tmp_path):
    """offload_param "nvme" in one process runs ZeRO at world size 1, whose gradients are kept
    as given: its own memory for each (None where bucket padding splits one)."""
    model = make_model()
    opt = zt.OffloadOptimizer(
        model.named_parameters(), lr=1e-2, model=model,
        config=config(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"},
                                         "offload_param": {"device": "nvme",
                                                           "nvme_path": str(tmp_path)}}))
    offered = {n: opt._zero.gradient_buffer(n) for n, _ in model.named_parameters()}
    assert any(b is not None for b in offered.values())
    for n, p in model.named_parameters():
        if offered[n] is not None:
            assert offered[n].dtype == np.uint8 and offered[n].nbytes == p.numel() * 4, n
    opt.close()


def test_auto_values_are_filled_or_named():
    cfg = config(optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                 gradient_clipping="auto")
    text = zoffload.load_config(cfg, lr=2e-5, weight_decay=0.1, gradient_clipping=1.0)
    parsed = json.loads(text)
    assert parsed["optimizer"]["params"]["lr"] == pytest.approx(2e-5)
    assert parsed["gradient_clipping"] == pytest.approx(1.0)
    with pytest.raises(zoffload.ConfigError, match=r"gradient_clipping"):
        zoffload.load_config(cfg, lr=2e-5, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"optimizer\.params\.lr"):
        zoffload.load_config(cfg)
    # zoffload.overlap "auto" is zoffload's own value, kept for the trainer to resolve.
    own = json.loads(zoffload.load_config(config(zoffload={"overlap": "auto"})))
    assert own["zoffload"]["overlap"] == "auto"


def test_bad_config_is_a_config_error_naming_the_path():
    with pytest.raises(zoffload.ConfigError, match=r"offload_optimizer\.devcie"):
        zoffload.load_config({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})
    with pytest.raises(zoffload.ConfigError, match=r"line 1"):
        zoffload.load_config("{not json")
    with pytest.raises(zoffload.ConfigError, match=r"/no/such/config.json"):
        zoffload.load_config("/no/such/config.json")


def test_bad_input_raises_clear_errors():
    model = make_model()
    opt = zt.OffloadOptimizer(model.named_parameters(), config(), lr=1e-3)
    e = opt.engine
    with pytest.raises(zoffload.FailedPrecondition, match="gradient"):
        opt.step()  # no gradient yet
    with pytest.raises(zoffload.NotFound, match="'nope'"):
        e.gradient_ready("nope", np.zeros(4, np.float32))
    with pytest.raises(zoffload.InvalidArgument, match="elements"):
        e.gradient_ready("embed.weight", np.zeros(5, np.float32))
    with pytest.raises(zoffload.InvalidArgument, match="float64"):
        e.gradient_ready("embed.weight", np.zeros(VOCAB * DIM, np.float64))
    with pytest.raises(zoffload.InvalidArgument, match="not contiguous"):
        e.gradient_ready("embed.weight", np.zeros((DIM, VOCAB), np.float32).T)
    with pytest.raises(zoffload.OutOfRange):
        e.set_group(7, {"lr": 1.0})
    with pytest.raises(zoffload.InvalidArgument, match="lr"):
        e.set_group(0, {"lr": -1.0})
    # After all that the optimizer still trains.
    loss_of(model, batches(1)[0][0]).backward()
    opt.step()
    assert opt.stats()["step"] == 1
    opt.close()
    with pytest.raises(zoffload.FailedPrecondition, match="closed"):
        e.step()


def test_bad_parameters_are_refused():
    t = torch.zeros(10, requires_grad=True)
    with pytest.raises(zoffload.AlreadyExists, match="'w'"):
        zt.OffloadOptimizer([("w", t), ("w", torch.zeros(3, requires_grad=True))], config())
    with pytest.raises(zoffload.InvalidArgument, match="float64"):
        zt.OffloadOptimizer([("d", torch.zeros(3, dtype=torch.float64, requires_grad=True))],
                            config())
    with pytest.raises(zoffload.InvalidArgument, match="no parameters"):
        zt.OffloadOptimizer([], config())
    with pytest.raises(zoffload.InvalidArgument, match="not contiguous"):
        zoffload.Engine(zoffload.load_config(config()),
                        [("x", np.zeros((4, 4), np.float32).T, 0)], [{}])
    with pytest.raises(ValueError, match="offload_optimizer.device"):  # nothing to offload
        zt.OffloadOptimizer([("w", t)], {"zero_optimization": {"stage": 2}})
    assert issubclass(zoffload.ResourceExhausted, MemoryError)
    assert issubclass(zoffload.DataLoss, OSError)
    assert issubclass(zoffload.ConfigError, ValueError)


def test_state_dict_round_trip_continues_bit_identically():
    data = batches(12)
    cfg = config(gradient_clipping=1.0)

    def run(model, opt, part):
        for (tokens,) in part:
            loss_of(model, tokens).backward()
            opt.step()

    model = make_model()
    opt = zt.OffloadOptimizer(groups_of(model, 0.05), cfg, lr=3e-3)
    run(model, opt, data[:6])
    saved = opt.state_dict()
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    run(model, opt, data[6:])  # the run to reproduce
    assert saved["steps"] == 6 and len(saved["state"]) == len(saved_params)

    fresh = make_model(seed=5)  # other values: load_state_dict must set the parameters
    opt2 = zt.OffloadOptimizer(groups_of(fresh, 0.05), cfg, lr=3e-3)
    opt2.load_state_dict(saved)
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach(), saved_params[n]), n
    run(fresh, opt2, data[6:])
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a.detach(), b.detach()), n
    assert opt2.engine.steps == 12
    broken = {**saved, "state": {k: v for k, v in list(saved["state"].items())[1:]}}
    with pytest.raises(zoffload.InvalidArgument, match="missing"):
        opt2.load_state_dict(broken)
    short = dict(saved["state"])
    name = next(iter(short))
    short[name] = {**short[name], "exp_avg": short[name]["exp_avg"][:-1]}
    with pytest.raises(zoffload.InvalidArgument, match="bytes"):
        opt2.load_state_dict({**saved, "state": short})


def test_fp16_loss_scale_skips_overflowing_steps():
    model = make_model()
    cfg = config(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    opt = zt.OffloadOptimizer(model.named_parameters(), cfg, lr=1e-3)
    assert opt.loss_scale == 256.0
    (tokens,) = batches(1)[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (loss_of(model, tokens) * float("inf")).backward()  # an overflow
    opt.step()
    assert opt.skipped_steps == 1 and opt.stats()["skipped"]
    assert opt.loss_scale == 128.0
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} changed on a skipped step"
    opt.backward(loss_of(model, tokens))  # scaled by 128; the engine unscales
    opt.step()
    assert opt.skipped_steps == 1 and opt.stats()["step"] == 1
    assert opt.stats()["grad_norm"] > 0
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    loss_of(ref_model, tokens).backward()
    ref.step()
    for (n, a), (_, b) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_defaults_alone_train_in_host_memory():
    model = make_model()
    opt = zt.OffloadOptimizer(model.parameters(), lr=1e-3)  # no config: optimizer in host memory
    (tokens,) = batches(1)[0]
    loss_of(model, tokens).backward()
    opt.step()
    assert opt.stats()["step"] == 1 and opt.engine.host_bytes > 0


def test_overlap_backward_is_identical_and_delayed_trains_one_step_behind():
    """zoffload.overlap: "backward" gives the very parameters of "none" (schedule, groups,
    accumulation); "delayed" runs its warm-up steps exactly, then trains on one-step-old
    parameters (the loss still falls), and flush() brings the model up to its last step."""
    data = batches(12, micro=2)

    def run(overlap, warmup=0):
        model = make_model()
        opt = zt.OffloadOptimizer(
            groups_of(model, 0.1),
            config(gradient_accumulation_steps=2,
                   zoffload={"overlap": overlap, "delayed_warmup_steps": warmup}),
            lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.2 * s))
        losses = train(model, opt, data, sched)
        opt.flush()
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return losses, params

    exact, exact_params = run("none")
    backward, backward_params = run("backward")
    assert backward == exact
    assert all(torch.equal(a, b) for a, b in zip(backward_params, exact_params))
    delayed, _ = run("delayed", warmup=3)
    assert delayed[:4] == exact[:4]  # step 4's loss: the warm-up's exact parameters
    assert delayed[4] != exact[4]
    assert delayed[-1] < 0.8 * delayed[0], delayed


def test_overlap_auto_updates_during_backward_and_clips_as_none():
    """"auto" picks "backward" here (one process, state in host memory); with the config's
    clipping (about half the steps clip) its steps commit, are redone or run exact, and the
    run is "none"'s bit for bit."""
    data = batches(12)

    def run(overlap):
        model = make_model()
        opt = zt.OffloadOptimizer(groups_of(model, 0.1),
                                  config(gradient_clipping=14.0, zoffload={"overlap": overlap}),
                                  lr=3e-3)
        kinds = []
        for (tokens,) in data:
            loss_of(model, tokens).backward()
            opt.step()
            opt.zero_grad()
            kinds.append(opt.stats()["speculation"])
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return params, kinds

    exact, none_kinds = run("none")
    auto, auto_kinds = run("auto")
    assert set(none_kinds) == {""}
    assert set(auto_kinds) == {"committed", "redone", "exact"}, auto_kinds
    assert all(torch.equal(a, b) for a, b in zip(auto, exact))


def test_save_then_load_in_a_new_process_continues_bit_identically(tmp_path):
    """opt.save(dir) after 6 steps; a new process builds the model with other values, loads
    the checkpoint and trains the last 6 steps: its parameters equal the uninterrupted run's.
    A damaged checkpoint is a DataLoss naming the file and changes nothing."""
    import os
    import subprocess
    import sys

    data = batches(12)
    cfg = config(gradient_clipping=1.0)
    model = make_model()
    opt = zt.OffloadOptimizer(groups_of(model, 0.05), cfg, lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    train(model, opt, data[:6], sched)
    ckpt = str(tmp_path / "ckpt")
    opt.save(ckpt)
    train(model, opt, data[6:], sched)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(data[6:], tmp_path / "data.pt")
    script = f"""
import torch, zoffload.torch as zt
from test_torch import make_model, groups_of, config, train
model = make_model(seed=5)
opt = zt.OffloadOptimizer(groups_of(model, 0.05), config(gradient_clipping=1.0), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
opt.load({ckpt!r})
for _ in range(6):  # the scheduler's own state is the caller's: replay it
    sched.step()
assert opt.engine.steps == 6, opt.engine.steps
train(model, opt, torch.load({str(tmp_path / 'data.pt')!r}), sched)
torch.save({{n: p.detach() for n, p in model.named_parameters()}}, {str(tmp_path / 'got.pt')!r})
"""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt")
    for n, p in want.items():
        assert torch.equal(got[n], p), n

    state = os.path.join(ckpt, "state.bin")
    with open(state, "r+b") as f:
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(zoffload.DataLoss, match="state.bin"):
        opt.load(ckpt)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    opt.close()


def test_only_the_users_own_unused_keys_are_warned_about():
    """The engine parses the normalized config (every key written out) without warning again:
    a default config prints nothing, a config that sets an unused key warns about it once."""
    import subprocess
    import sys

    code = ("import torch, zoffload.torch as zt\n"
            "zt.OffloadOptimizer(torch.nn.Linear(3, 2).named_parameters(), config=CONFIG)\n")
    quiet = subprocess.run([sys.executable, "-c", code.replace("CONFIG", "None")],
                           capture_output=True, text=True, check=True)
    assert quiet.stderr == "", quiet.stderr
    cfg = ('{"wall_clock_breakdown": True, "zero_optimization": {"stage": 2, '
           '"offload_optimizer": {"device": "cpu"}}}')
    warned = subprocess.run([sys.executable, "-c", code.replace("CONFIG", cfg)],
                            capture_output=True, text=True, check=True)
    lines = [l for l in warned.stderr.splitlines() if "warning" in l]
    assert len(lines) == 1 and "wall_clock_breakdown" in lines[0], warned.stderr
