"""OffloadOptimizer on CUDA: a bf16 model against the reference a user would write (torch AdamW
over fp32 master weights on the GPU), and no gradient left on the GPU after the hooks."""

import pytest
import torch

import zoffload.torch as zt
from test_torch import batches, config, loss_of, make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_bf16_on_cuda_matches_fp32_master_adamw_and_frees_every_gradient():
    steps, lr = 20, 3e-3
    data = [[t.cuda() for t in mb] for mb in batches(steps)]
    ours_model = make_model().cuda().to(torch.bfloat16)
    ref_model = make_model().cuda().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in ref_model.parameters()]
    ref = torch.optim.AdamW(masters, lr=lr, weight_decay=0.01)
    opt = zt.OffloadOptimizer(ours_model.named_parameters(), config(), lr=lr, weight_decay=0.01)
    assert opt.engine.on_gpu
    grad_bytes = sum(p.numel() * p.element_size() for p in ours_model.parameters())
    ours_losses, ref_losses = [], []
    for i, (tokens,) in enumerate(data):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = loss_of(ours_model, tokens).float()
        loss.backward()
        ours_losses.append(loss.item())
        del loss
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        assert all(p.grad is None for p in ours_model.parameters()), "a gradient stayed"
        # The first backward allocates cuBLAS's workspace (tens of MB) once; after that,
        # nothing of the gradients may stay.
        if i > 0:
            assert after - before < grad_bytes // 4, f"{after - before} bytes left after backward"
        opt.step()
        # The reference: bf16 forward/backward, fp32 masters updated by torch AdamW on the GPU.
        loss = loss_of(ref_model, tokens).float()
        loss.backward()
        ref_losses.append(loss.item())
        for m, p in zip(masters, ref_model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref.step()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters()):
                p.copy_(m.to(torch.bfloat16))
    for i, (a, b) in enumerate(zip(ours_losses, ref_losses)):
        assert abs(a - b) <= 1e-2 * abs(b), f"step {i}: {a} vs {b}\n{ours_losses}\n{ref_losses}"
    assert ours_losses[-1] < ours_losses[0]
    opt.close()
