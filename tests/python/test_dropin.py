"""Training loops as people write them, against torch.optim.AdamW in the same loop (host mode,
CPU): clipping (torch.nn.utils.clip_grad_norm_ from a plain loop, Accelerate's clip_grad_norm_)
reaches the engine, which clips with the exact global norm and returns it (overlap "backward"
too); accumulation by
repeated backward before step() adds up as torch's .grad does, with no config key."""

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


def run(opt_of, max_norm, micro=1):
    """Each step: `micro` backward passes (the batch split, the loss divided as torch users
    do), clip_grad_norm_, step, zero_grad."""
    model, data = model_and_data()
    opt = opt_of(model)
    losses, norms, kinds = [], [], []
    for x, y in data:
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = torch.nn.functional.mse_loss(model(xs), ys) / micro
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if isinstance(opt, zt.OffloadOptimizer):
            kinds.append(opt.stats()["speculation"])
    return losses, norms, opt, kinds


def ours(model, overlap="none", micro=1):
    """Overlap "backward" needs the micro-batches declared (its updates start at the last)."""
    config = {**CONFIG, "zoffload": {"overlap": overlap}}
    if overlap != "none":
        config["gradient_accumulation_steps"] = micro
    return zt.OffloadOptimizer(model.named_parameters(), config, lr=0.05, weight_decay=0.01)


def reference(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


# Tolerances: the norm is summed in float64 by the engine and in float32 by torch (relative
# 1e-5 covers both roundings); the losses follow from updates equal to float32 rounding.
NORM_REL, LOSS_REL = 1e-5, 1e-4


@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("micro", [1, 3])
def test_a_plain_loops_clip_grad_norm_clips_with_the_exact_norm(micro, overlap):
    """Under overlap "backward" too: its updates made during backward are redone where the
    step clips (about half the steps here), and the run is "none"'s."""
    _, free_norms, _, _ = run(reference, math.inf, micro)
    max_norm = sorted(free_norms)[len(free_norms) // 2]  # clips about half the steps
    a_losses, a_norms, opt, kinds = run(lambda m: ours(m, overlap, micro), max_norm, micro)
    b_losses, b_norms, _, _ = run(reference, max_norm, micro)
    assert sum(n > max_norm for n in b_norms) >= 4, "clipping was not active"
    for i, (a, b) in enumerate(zip(a_norms, b_norms)):
        assert a == pytest.approx(b, rel=NORM_REL), f"step {i}: norm {a} vs torch's {b}"
        assert opt.stats()["grad_norm"] > 0
    for i, (a, b) in enumerate(zip(a_losses, b_losses)):
        assert a == pytest.approx(b, rel=LOSS_REL), f"step {i}: loss {a} vs torch's {b}"
    if overlap == "backward":
        assert {"committed", "redone", "exact"} <= set(kinds), kinds
        e_losses, _, _, _ = run(lambda m: ours(m, "none", micro), max_norm, micro)
        assert a_losses == e_losses  # the exact step's, bit for bit
    else:
        assert set(kinds) == {""}
    # Without the loop's clipping the runs part: the clip reached the step.
    c_losses, _, _, _ = run(lambda m: ours(m, overlap, micro), math.inf, micro)
    assert c_losses[-1] != pytest.approx(a_losses[-1], rel=LOSS_REL)
    opt.close()


@pytest.mark.parametrize("micro", [1, 3])
def test_an_accelerate_loop_clips_and_accumulates_through_the_engine(micro):
    """Accelerate's accumulate() (micro-batches, the optimizer's step and zero_grad skipped
    until the last) and its clip_grad_norm_, as its documentation writes the loop."""
    accelerate = pytest.importorskip("accelerate")
    _, free_norms, _, _ = run(reference, math.inf, micro)
    max_norm = sorted(free_norms)[len(free_norms) // 2]
    b_losses, b_norms, _, _ = run(reference, max_norm, micro)
    model, data = model_and_data()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=micro)
    model, opt = accelerator.prepare(model, ours(model))
    norms, losses = [], []
    for x, y in data:
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xs), ys)
                accelerator.backward(loss)  # divides by the accumulation steps
                total += loss.item() / micro
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
                opt.step()
                opt.zero_grad()
        losses.append(total)
    assert norms == pytest.approx(b_norms, rel=NORM_REL)
    assert losses == pytest.approx(b_losses, rel=LOSS_REL)


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
