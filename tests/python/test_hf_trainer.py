"""HuggingFace's Trainer with optimizers=(OffloadOptimizer, scheduler), on the CPU (host mode):
it trains, its LR schedule reaches the engine, and its checkpoint saves and restores the
optimizer's state."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zoffload.torch as zt  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=128):
        g = torch.Generator().manual_seed(0)
        base = torch.randint(0, vocab, (4, seq), generator=g)
        self.rows = base[torch.randint(0, 4, (n,), generator=g)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def test_trainer_trains_schedules_and_checkpoints(tmp_path):
    model = tiny_gpt2()
    ds_config = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "gradient_clipping": "auto",
    }
    opt = zt.OffloadOptimizer(model.named_parameters(), ds_config, lr=1e-2, weight_decay=0.0,
                              gradient_clipping=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8, logging_steps=1,
        save_steps=4, save_strategy="steps", report_to=[], use_cpu=True, max_grad_norm=0.0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizers=(opt, sched))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert opt.engine.steps == 8
    assert opt.engine.group(0)["lr"] == pytest.approx(1e-2 / 8)  # the 8th step's lr
    saved = torch.load(tmp_path / "checkpoint-4" / "optimizer.pt", weights_only=False)
    assert saved["steps"] == 4 and len(saved["state"]) == len(list(model.parameters()))


def _trainer_run(tmp_path, make_opt):
    """8 steps of the Trainer with its default clipping (max_grad_norm 1.0) and a linear
    warm-up schedule: the logged losses and grad norms."""
    model = tiny_gpt2()
    opt = make_opt(model)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=3,
                                                         num_training_steps=8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-2,
    )
    assert args.max_grad_norm == 1.0
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizers=(opt, sched))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


# The Trainer's own clipping (accelerate's clip_grad_norm_, max_grad_norm 1.0) reaches the engine:
# the same logged losses and grad norms as with torch.optim.AdamW, with clipping active. The
# norms are summed in float64 by the engine and in float32 by torch: relative 1e-5; the losses
# follow updates equal to float32 rounding: relative 1e-4.
def test_trainer_defaults_clip_through_the_engine_as_with_torch_adamw(tmp_path):
    ours_loss, ours_norm = _trainer_run(
        tmp_path / "ours",
        lambda m: zt.OffloadOptimizer(m.named_parameters(), None, lr=1e-2, weight_decay=0.0))
    ref_loss, ref_norm = _trainer_run(
        tmp_path / "ref", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0))
    assert sum(n > 1.0 for n in ref_norm) >= 2, f"clipping was not active: {ref_norm}"
    assert ours_norm == pytest.approx(ref_norm, rel=1e-5)
    assert ours_loss == pytest.approx(ref_loss, rel=1e-4)
