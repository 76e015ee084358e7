"""Clipping as training loops write it: torch.nn.utils.clip_grad_norm_ from a plain loop and
Accelerate's clip_grad_norm_ reach the engine, which clips with the exact global norm and
returns it; against torch.optim.AdamW + torch's own clipping (host mode, CPU)."""

import math

import pytest
import torch

import zoffload
import zoffload.torch as zt

CONFIG = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def model_and_data(seed=0, steps=16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    g = torch.Generator().manual_seed(seed + 1)
    data = [(torch.randn(9, 12, generator=g), torch.randn(9, 3, generator=g)) for _ in range(steps)]
    return model, data


def run(opt_of, max_norm, clip=torch.nn.utils.clip_grad_norm_):
    model, data = model_and_data()
    opt = opt_of(model)
    losses, norms = [], []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(clip(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, opt


def ours(model):
    return zt.OffloadOptimizer(model.named_parameters(), CONFIG, lr=0.05, weight_decay=0.01)


def reference(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


# Tolerances: the norm is summed in float64 by the engine and in float32 by torch (relative
# 1e-5 covers both roundings); the losses follow from updates equal to float32 rounding.
NORM_REL, LOSS_REL = 1e-5, 1e-4


def test_a_plain_loops_clip_grad_norm_clips_with_the_exact_norm():
    _, free_norms, _ = run(reference, math.inf)
    max_norm = sorted(free_norms)[len(free_norms) // 2]  # clips about half the steps
    a_losses, a_norms, opt = run(ours, max_norm)
    b_losses, b_norms, _ = run(reference, max_norm)
    assert sum(n > max_norm for n in b_norms) >= 4, "clipping was not active"
    for i, (a, b) in enumerate(zip(a_norms, b_norms)):
        assert a == pytest.approx(b, rel=NORM_REL), f"step {i}: norm {a} vs torch's {b}"
        assert opt.stats()["grad_norm"] > 0
    for i, (a, b) in enumerate(zip(a_losses, b_losses)):
        assert a == pytest.approx(b, rel=LOSS_REL), f"step {i}: loss {a} vs torch's {b}"
    # Without the loop's clipping the runs part: the clip reached the step.
    c_losses, _, _ = run(ours, math.inf)
    assert c_losses[-1] != pytest.approx(a_losses[-1], rel=LOSS_REL)
    opt.close()


def test_accelerates_clip_grad_norm_reaches_the_engine():
    accelerate = pytest.importorskip("accelerate")
    _, free_norms, _ = run(reference, math.inf)
    max_norm = sorted(free_norms)[len(free_norms) // 2]
    b_losses, b_norms, _ = run(reference, max_norm)
    model, data = model_and_data()
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, ours(model))
    for i, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        assert float(norm) == pytest.approx(b_norms[i], rel=NORM_REL), f"step {i}"
        assert loss.item() == pytest.approx(b_losses[i], rel=LOSS_REL), f"step {i}"


def test_clip_grad_norm_leaves_other_parameters_to_torch_and_refuses_a_mix():
    model, opt, _ = None, None, None
    model, data = model_and_data()
    opt = ours(model)
    other = torch.nn.Linear(3, 3)
    other(torch.ones(2, 3)).sum().backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in other.parameters()]))
    assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9)) == pytest.approx(
        float(want))
    x, y = data[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(zoffload.InvalidArgument, match="mix"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(other.parameters()), 1.0)
    with pytest.raises(zoffload.Unimplemented, match="norm_type"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)
    opt.close()  # a closed optimizer's parameters are torch's again
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0


def test_clipping_under_overlap_backward_is_a_clear_error_not_a_silent_no_op():
    model, data = model_and_data()
    opt = zt.OffloadOptimizer(model.named_parameters(),
                              {**CONFIG, "zoffload": {"overlap": "backward"}}, lr=0.05)
    x, y = data[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(zoffload.FailedPrecondition, match="overlap"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.close()


def test_a_nonfinite_norm_is_returned_and_refused_when_asked():
    model, data = model_and_data()
    opt = ours(model)
    model(torch.full((2, 12), float("nan"))).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(norm)
    with pytest.raises(RuntimeError, match="not finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    opt.step()
    assert opt.stats()["skipped"]
    opt.close()
