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


def _trainer_run(tmp_path, make_opt, accumulation):
    """8 steps of the Trainer with its default clipping (max_grad_norm 1.0), `accumulation`
    micro-batches a step (gradient_accumulation_steps: repeated backward, no zoffload config)
    and a linear warm-up schedule: the logged losses and grad norms."""
    model = tiny_gpt2()
    opt = make_opt(model)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=3,
                                                         num_training_steps=8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-2,
        gradient_accumulation_steps=accumulation,
    )
    assert args.max_grad_norm == 1.0
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizers=(opt, sched))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


# The Trainer's own clipping (accelerate's clip_grad_norm_, max_grad_norm 1.0) and accumulation
# (repeated backward) reach the engine: the same logged losses and grad norms as with
# torch.optim.AdamW, with clipping active. The norms are summed in float64 by the engine and in
# float32 by torch: relative 1e-5; the losses follow updates equal to float32 rounding:
# relative 1e-4.
@pytest.mark.parametrize("accumulation", [1, 4])
def test_trainer_defaults_clip_and_accumulate_as_with_torch_adamw(tmp_path, accumulation):
    ours_loss, ours_norm = _trainer_run(
        tmp_path / "ours",
        lambda m: zt.OffloadOptimizer(m.named_parameters(), None, lr=1e-2, weight_decay=0.0),
        accumulation)
    ref_loss, ref_norm = _trainer_run(
        tmp_path / "ref", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0),
        accumulation)
    assert sum(n > 1.0 for n in ref_norm) >= 2, f"clipping was not active: {ref_norm}"
    assert ours_norm == pytest.approx(ref_norm, rel=1e-5)
    assert ours_loss == pytest.approx(ref_loss, rel=1e-4)


# zoffload.hf.Trainer, the two-line change: the optimizer from the TrainingArguments (the
# micro-batches per step declared to the engine), the same curves as the Trainer's own AdamW
# (whose decay groups it copies), and a run resumed from its checkpoint equal to one that ran
# straight through.
def test_zoffload_hf_trainer_matches_the_trainers_adamw_and_resumes(tmp_path):
    import zoffload.hf

    def run(trainer_cls, out, steps=6, resume=None, save=False):
        model = tiny_gpt2()
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, max_steps=steps,
            logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
            learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, gradient_accumulation_steps=4,
            save_strategy="steps" if save else "no", save_steps=3)
        trainer = trainer_cls(model=model, args=args, train_dataset=Tokens())
        trainer.train(resume_from_checkpoint=resume)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return [h["loss"] for h in logs], [h["grad_norm"] for h in logs], trainer

    ours_loss, ours_norm, trainer = run(zoffload.hf.Trainer, tmp_path / "ours", save=True)
    assert isinstance(trainer.optimizer.optimizer, zt.OffloadOptimizer)
    # The defaults update during backward ("auto"), with the Trainer's clipping (max_grad_norm
    # 1.0): each step committed, was redone, or ran exact after one that clipped.
    assert trainer.optimizer.optimizer.stats()["speculation"] in ("committed", "redone", "exact")
    ref_loss, ref_norm, _ = run(transformers.Trainer, tmp_path / "ref")
    assert ours_norm == pytest.approx(ref_norm, rel=1e-5)
    assert ours_loss == pytest.approx(ref_loss, rel=1e-4)
    checkpoint = tmp_path / "ours" / "checkpoint-3"
    assert (checkpoint / zoffload.hf.CHECKPOINT_DIR / "manifest.json").is_file()
    resumed_loss, _, _ = run(zoffload.hf.Trainer, tmp_path / "ours", resume=str(checkpoint))
    assert resumed_loss[-3:] == pytest.approx(ours_loss[-3:], rel=1e-6)
