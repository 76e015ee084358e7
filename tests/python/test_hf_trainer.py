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
