"""Checkpointed activations in host memory (zoffload.activations, config
activation_checkpointing.cpu_checkpointing): the checkpoints' saved inputs go through the
offload (counted), and the gradients equal the same run's without it, bit for bit — torch's
checkpoint in both styles, a HuggingFace model's gradient checkpointing through
OffloadOptimizer; a budget too small is an error naming it; uninstalling puts torch's
function back. (On this CPU machine the copies are plain host copies; the CUDA path is in
test_torch_gpu.py.)"""

import pytest
import torch
import torch.utils.checkpoint

import zoffload
import zoffload.torch as zt
from zoffload.activations import ActivationOffload


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(torch.nn.Module):
    """Blocks run through torch.utils.checkpoint.checkpoint, looked up at call time (as
    user code does)."""

    def __init__(self, width=32, depth=4, reentrant=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 5)
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def grads_of(reentrant, offload):
    torch.manual_seed(0)
    model = Stack(reentrant=reentrant)
    x = torch.randn(8, 16, 32, requires_grad=reentrant)  # reentrant needs an input with grad
    if offload is not None:
        offload.install()
    try:
        for _ in range(2):  # a second forward reuses the pooled buffers
            model.zero_grad()
            model(x).square().mean().backward()
    finally:
        if offload is not None:
            offload.uninstall()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_gradients_are_bit_identical(reentrant):
    original = torch.utils.checkpoint.checkpoint
    offload = ActivationOffload(min_bytes=1024)
    plain = grads_of(reentrant, None)
    offloaded = grads_of(reentrant, offload)
    assert torch.utils.checkpoint.checkpoint is original  # uninstalled
    assert offload.packed_tensors == 2 * 4  # each block's input, each forward
    assert offload.packed_bytes == 2 * 4 * 8 * 16 * 32 * 4
    assert offload.host_bytes == 4 * 8 * 16 * 32 * 4  # the second forward reused the buffers
    assert all(torch.equal(a, b) for a, b in zip(offloaded, plain))


def test_as_a_context_manager_it_offloads_inside_the_block_only():
    original = torch.utils.checkpoint.checkpoint
    plain = grads_of(False, None)
    with ActivationOffload(min_bytes=1024) as offload:
        assert torch.utils.checkpoint.checkpoint is not original
        inside = grads_of(False, None)
    assert torch.utils.checkpoint.checkpoint is original
    assert offload.packed_tensors == 2 * 4
    assert all(torch.equal(a, b) for a, b in zip(inside, plain))


def test_other_saved_tensors_go_inside_saved_tensors():
    """Any region's saved tensors (not a checkpoint's) through offload.saved_tensors()."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)

    def grad(offload):
        w.grad = None
        if offload is None:
            (x @ w).relu().square().sum().backward()
        else:
            with offload.saved_tensors():
                y = (x @ w).relu().square().sum()
            y.backward()
        return w.grad.clone()

    offload = ActivationOffload(min_bytes=1024)
    plain = grad(None)
    assert torch.equal(grad(offload), plain)
    assert offload.packed_tensors >= 2  # x, w, the matmul's output: all above 1 KiB


def test_small_tensors_stay_and_a_budget_too_small_names_itself():
    small = ActivationOffload(min_bytes=1 << 30)
    grads_of(False, small)
    assert small.packed_tensors == 0
    tight = ActivationOffload(min_bytes=1024, budget_bytes=3 * 8 * 16 * 32 * 4)
    with pytest.raises(zoffload.ResourceExhausted, match="activation_host_bytes"):
        grads_of(False, tight)


def test_hf_gradient_checkpointing_through_the_optimizer_is_bit_identical():
    transformers = pytest.importorskip("transformers")

    def run(cpu_checkpointing):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=101, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
        model.config.use_cache = False
        model.train()
        opt = zt.OffloadOptimizer(
            model.named_parameters(),
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
             "activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing},
             "zoffload": {"activation_min_bytes": 1024}},
            lr=1e-2, model=model)
        model.gradient_checkpointing_enable()  # after the optimizer, as the Trainer may
        ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        stats = opt.stats()
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return losses, params, stats

    plain_losses, plain_params, _ = run(False)
    losses, params, stats = run(True)
    assert stats["activations_offloaded"] == 3 * 3  # each layer's input, each step
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
