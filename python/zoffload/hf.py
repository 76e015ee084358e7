"""HuggingFace's Trainer with zoffload: a Trainer script changes by two lines::

    from zoffload.hf import Trainer                      # was: from transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      zoffload_config="ds_config.json")  # + 1 (optional: defaults offload to cpu)

``Trainer`` is ``transformers.Trainer`` whose optimizer is an ``OffloadOptimizer`` built from
the ``TrainingArguments``: lr, betas, eps and weight decay (none for biases and norms, as the
Trainer's own AdamW), ``gradient_accumulation_steps`` (written into the config, which the
engine needs on a GPU) and bf16. The Trainer's own pieces work unchanged: its LR schedule
(warm-up included) drives the engine's groups, its clipping (``max_grad_norm``, 1.0 by default)
reaches the engine through ``clip_grad_norm_`` (the exact global norm, logged as
``grad_norm``), and its checkpoints hold zoffload's own (``checkpoint-N/zoffload/``: atomic,
checksummed, fp32 masters and moments) beside the scheduler's state, from which
``train(resume_from_checkpoint=...)`` continues.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import transformers

from . import _zoffload
from .config import ConfigSource, _read
from .torch import OffloadOptimizer

# In checkpoint-N/: zoffload's checkpoint of the optimizer, and the scheduler's state.
CHECKPOINT_DIR = "zoffload"
SCHEDULER_FILE = "scheduler.pt"


def config_for(args: transformers.TrainingArguments, config: ConfigSource = None) -> dict:
    """The zoffload config for a Trainer run: `config` (a path, JSON text, a dict or None: the
    optimizer in host memory, updated during backward where the run allows, exactly:
    ``zoffload.overlap`` "auto") with the micro-batches per step and bf16 taken from `args`; a
    value the config sets otherwise is an error naming both."""
    cfg = _read(config) or {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zoffload": {"overlap": "auto"}}
    if args.fp16:
        raise _zoffload.ConfigError(
            "zoffload.hf.Trainer: fp16=True uses torch's GradScaler, which cannot see the "
            "gradients the engine holds; use bf16=True (or zoffload's own fp16 config with a "
            "plain loop)")
    for key, value in (("gradient_accumulation_steps", args.gradient_accumulation_steps),):
        given = cfg.get(key, "auto")
        if given not in ("auto", value):
            raise _zoffload.ConfigError(
                f"zoffload.hf.Trainer: the config's {key} is {given}, the TrainingArguments' "
                f"{value}: give one")
        cfg[key] = value
    bf16 = cfg.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = bool(args.bf16)
    return cfg


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` training through an ``OffloadOptimizer`` (see the module's
    docstring). ``zoffload_config``: the zoffload config (path, JSON text or dict); HF's
    ``"auto"`` values are filled from the ``TrainingArguments``."""

    def __init__(self, *args: Any, zoffload_config: ConfigSource = None, **kwargs: Any) -> None:
        self.zoffload_config = zoffload_config
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            a = self.args
            groups = [g for g in (
                {"params": [(n, p) for n, p in named if n in decay], "weight_decay": a.weight_decay},
                {"params": [(n, p) for n, p in named if n not in decay], "weight_decay": 0.0},
            ) if g["params"]]
            micro = a.per_device_train_batch_size
            self.optimizer = OffloadOptimizer(
                groups, config_for(a, self.zoffload_config), lr=a.learning_rate,
                betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                weight_decay=a.weight_decay, model=model, train_micro_batch_size_per_gpu=micro,
                train_batch_size=micro * a.gradient_accumulation_steps * a.world_size,
                gradient_clipping=a.max_grad_norm)
        return self.optimizer

    def _offload_optimizer(self) -> OffloadOptimizer:
        """The OffloadOptimizer inside Accelerate's wrapper."""
        opt = self.optimizer
        while not isinstance(opt, OffloadOptimizer):
            opt = opt.optimizer
        return opt

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._offload_optimizer().save(os.path.join(output_dir, CHECKPOINT_DIR))
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        saved = os.path.join(checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(saved):
            raise _zoffload.NotFound(
                f"zoffload.hf.Trainer: {checkpoint} holds no {CHECKPOINT_DIR}/ (it was not written "
                "by zoffload.hf.Trainer)")
        self._offload_optimizer().load(saved)
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))


__all__ = ["CHECKPOINT_DIR", "Trainer", "config_for"]
