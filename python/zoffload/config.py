"""Configs for zoffload: a path, a JSON string or a dict, with HuggingFace's ``"auto"`` values.

A DeepSpeed-style config written for HuggingFace's Trainer leaves values as ``"auto"`` for the
training code to fill. ``load_config`` fills them from what the caller knows (the optimizer's
lr, betas, eps and weight decay; batch sizes; clipping) and refuses any ``"auto"`` left over,
naming its JSON path. The C++ side reads the JSON (a file or text) and validates the whole config strictly: Python
parses no config of its own.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Union

from ._zoffload import ConfigError, ParsedConfig, parse_config_object, read_config_json

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], None]

# JSON path -> the name of the known value that fills it.
AUTO_FILLS = {
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "weight_decay",
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
}
# Where "auto" is a value of zoffload's own, which the parser resolves (not filled here).
OWN_AUTO = {"zoffload.overlap"}


def _read(source: ConfigSource) -> dict:
    """The config as a dict, read and parsed by the C++ parser (one parser for both languages:
    only regular files of at most 16 MiB, strict JSON, numbers kept as written)."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        try:
            text = json.dumps(source, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"the config dict is not plain JSON: {e}") from e
        is_file = False
    else:
        text = os.fspath(source)
        is_file = not text.lstrip().startswith("{")
    value = json.loads(read_config_json(text, is_file))
    if not isinstance(value, dict):
        where = text if is_file else "the config string"
        raise ConfigError(f"{where}: (root): expected an object, got {type(value).__name__}")
    return value


def _fill(node: Any, path: str, known: Mapping[str, Any], left: list) -> Any:
    if isinstance(node, dict):
        return {k: _fill(v, f"{path}.{k}" if path else k, known, left) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, f"{path}[{i}]", known, left) for i, v in enumerate(node)]
    if node == "auto" and path not in OWN_AUTO:
        name = AUTO_FILLS.get(path)
        if name is not None and known.get(name) is not None:
            value = known[name]
            return list(value) if isinstance(value, tuple) else value
        left.append(path)
    return node


def load_config(source: ConfigSource = None, **known: Any) -> str:
    """The config as validated, normalized JSON text.

    ``source`` is a file path, a JSON string, a dict or None (every default). ``known`` fills
    ``"auto"`` values: lr, betas, eps, weight_decay, train_batch_size,
    train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping, fp16,
    bf16. Raises ConfigError naming the JSON path of any ``"auto"`` left, or of what the
    strict parser refuses.
    """
    return parsed_config(source, **known).json


def parsed_config(source: ConfigSource = None, **known: Any) -> ParsedConfig:
    """load_config's config as the C++ side parsed it, once: what zoffload.torch builds its
    optimizer from (its ``json`` is load_config's text)."""
    left: list = []
    filled = _fill(_read(source), "", known, left)
    if left:
        raise ConfigError(
            "unresolved \"auto\" at "
            + ", ".join(left)
            + ": give the value in the config, or to load_config/OffloadOptimizer"
            + " (zoffload fills "
            + ", ".join(sorted(AUTO_FILLS))
            + ")"
        )
    return parse_config_object(json.dumps(filled))
