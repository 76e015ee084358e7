"""zoffload: train models larger than the GPU from your own loop.

The optimizer (fp32 master weights and Adam moments) lives in host memory or on NVMe and is
updated on the CPU from gradients handed over as backward produces them; the model keeps its
low-precision parameters on the GPU. ``zoffload.torch.OffloadOptimizer`` is the PyTorch front;
``Engine`` is the C++ engine itself (DLPack arrays: torch, numpy, cupy).

Every error is a ``zoffload.Error`` carrying the C++ message; each kind is also the matching
built-in (``ConfigError`` is a ``ValueError``, ``ResourceExhausted`` a ``MemoryError``,
``DataLoss`` an ``OSError``, ...).
"""

import os as _os
import sys as _sys

# libzoffload's OpenMP is the system's libgomp. torch loads its own renamed copy with
# RTLD_GLOBAL; without deep binding, some of libzoffload's OpenMP calls would resolve into that
# copy and others into the system one, two runtimes mixed in one parallel region.
_flags = _sys.getdlopenflags()
_sys.setdlopenflags(_flags | getattr(_os, "RTLD_DEEPBIND", 0))
try:
    from . import _zoffload  # noqa: F401  (loaded here, with deep binding)
finally:
    _sys.setdlopenflags(_flags)

from ._zoffload import (  # noqa: E402
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
)
from .config import load_config  # noqa: E402

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
    "load_config",
]
