"""zoffload: train models larger than the GPU from your own loop.

The optimizer (fp32 master weights and Adam moments) lives in host memory or on NVMe and is
updated on the CPU from gradients handed over as backward produces them; the model keeps its
low-precision parameters on the GPU. ``zoffload.torch.OffloadOptimizer`` is the PyTorch front;
``Engine`` is the C++ engine itself (DLPack arrays: torch, numpy, cupy).

Every error is a ``zoffload.Error`` carrying the C++ message; each kind is also the matching
built-in (``ConfigError`` is a ``ValueError``, ``ResourceExhausted`` a ``MemoryError``,
``DataLoss`` an ``OSError``, ...).
"""

from ._zoffload import (
    AlreadyExists,
    Cancelled,
    ConfigError,
    DataLoss,
    Engine,
    Error,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    IoError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
    export_safetensors,
)
from .config import load_config

__all__ = [
    "AlreadyExists",
    "Cancelled",
    "ConfigError",
    "DataLoss",
    "Engine",
    "Error",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "IoError",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "Unavailable",
    "Unimplemented",
    "export_safetensors",
    "load_config",
]
