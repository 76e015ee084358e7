"""Checkpointed activations in host memory (config ``activation_checkpointing.cpu_checkpointing``).

With activation checkpointing, what a model keeps between forward and backward is the saved
input of each checkpointed block (the rest is recomputed in backward): at 32K tokens of a 7B
Llama, 32 x 32768 x 4096 bf16 values, 8 GiB. ``ActivationOffload`` moves those inputs to pinned
host memory while forward goes on and brings them back ahead of the backward that needs them:

- It wraps the checkpoint function (``torch.utils.checkpoint.checkpoint``, and a HuggingFace
  model's ``_gradient_checkpointing_func`` on each of its layers) so that the tensors the
  checkpoint itself saves — its inputs, in both torch styles (reentrant: the function's
  ``save_for_backward``; non-reentrant: the inputs it keeps for the recomputation) — pass
  through ``torch.autograd.graph.saved_tensors_hooks`` of ours. The tensors saved inside the
  block are the checkpoint's own business (recomputed), and those saved outside any checkpoint
  stay where they are.
- Pack (forward): a CUDA tensor of at least ``min_bytes`` is copied to a pinned host buffer on
  a side stream, ordered after the work that made it; the caching allocator is told the side
  stream uses it (``record_stream``), so its GPU memory returns to the pool once the copy is
  done, without the compute stream waiting. Smaller tensors, parameters and CPU tensors stay.
- Unpack (backward, last block first): the tensor comes back on the side stream (if the
  prefetch has not brought it already) and the compute stream waits for that copy only; then
  the next ``prefetch`` tensors in reverse order of packing are sent up, so the block before
  finds its input on the GPU when its backward starts.
- Pinned buffers are pooled by size and reused once their upload is done; ``budget_bytes``
  (``zoffload.budgets.activation_host_bytes``) caps the pool: a pack that would exceed it is a
  ``ResourceExhausted`` naming the key, the bytes held and the tensor's size.

Values are copied, not changed: gradients are bit-identical to the same run without offload.
A CPU tensor (host mode, the tests) takes the same path with plain synchronous copies into
pageable buffers: the bookkeeping is the same, only the streams are missing.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint

from ._zoffload import ResourceExhausted


def timing_event(stream: Optional[Any] = None) -> Any:
    """A CUDA timing event recorded now on `stream` (the current one by default)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class _Held:
    """One packed tensor: its pinned copy, the events of its copies, and its GPU tensor once
    brought back."""

    __slots__ = ("host", "device", "meta", "down", "gpu", "up", "index", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, meta: tuple, down: Any,
                 index: int):
        self.host = host
        self.device = device
        self.meta = meta  # dtype, shape, stride, contiguous
        self.down = down  # CUDA: event, the D2H copy is done
        self.gpu: Optional[torch.Tensor] = None  # back on its device (bytes)
        self.up = None  # CUDA: event, the H2D copy is done
        self.index = index


class ActivationOffload:
    """Saved inputs of checkpointed blocks in pinned host memory (see the module's doc)."""

    def __init__(self, min_bytes: int = 1 << 20, budget_bytes: Optional[int] = None,
                 prefetch: int = 2):
        if min_bytes < 0 or prefetch < 0 or (budget_bytes is not None and budget_bytes < 0):
            raise ValueError(f"ActivationOffload: min_bytes {min_bytes}, budget_bytes "
                             f"{budget_bytes}, prefetch {prefetch}: none may be negative")
        self.min_bytes = min_bytes
        self.budget_bytes = budget_bytes
        self.prefetch = prefetch
        self._stream = None  # the side stream, made at the first CUDA tensor
        # (bytes, pinned) -> [(buffer, event after its last upload, or None)]
        self._free: Dict[tuple, List[Any]] = {}
        self._held_bytes = 0  # bytes the pool holds, in use or free
        self._packed: List[weakref.ref] = []  # this forward's handles, in packing order
        self._unpacking = False  # backward has begun taking them back
        self.packed_tensors = 0  # totals since made (stats)
        self.packed_bytes = 0
        self.prefetched_tensors = 0
        # Timing events: each copy on the side stream, and each wait of the compute stream for
        # one (take_seconds).
        self._copy_spans: List[Tuple[Any, Any]] = []
        self._wait_spans: List[Tuple[Any, Any]] = []
        self._wrapped: Dict[int, Callable] = {}
        self._torch_checkpoint: Optional[Callable] = None

    # ---- the saved-tensor hooks --------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or nbytes == 0 or isinstance(t, torch.nn.Parameter):
            return t
        if self._unpacking:  # a new forward: the last one's handles are the graph's now
            self._packed, self._unpacking = [], False
        cuda = t.device.type == "cuda"
        host = self._buffer(nbytes, t, pin=cuda)
        flat = t.detach().reshape(-1).view(torch.uint8)  # (a copy where t is not contiguous)
        down = None
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=t.device)
            self._stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self._stream):
                started = timing_event(self._stream)
                host.copy_(flat, non_blocking=True)
                down = timing_event(self._stream)
            self._copy_spans.append((started, down))
            t.record_stream(self._stream)  # its memory is the pool's again after the copy
            flat.record_stream(self._stream)
        else:
            host.copy_(flat)
        meta = (t.dtype, t.shape, t.stride(), t.is_contiguous())
        held = _Held(host, t.device, meta, down, len(self._packed))
        self._packed.append(weakref.ref(held))
        weakref.finalize(held, self._release, host, nbytes)
        self.packed_tensors += 1
        self.packed_bytes += nbytes
        return held

    def _unpack(self, held: Any) -> torch.Tensor:
        if isinstance(held, torch.Tensor):
            return held
        self._unpacking = True
        if held.gpu is None:
            self._bring_up(held)
        else:
            self.prefetched_tensors += 1
        data = held.gpu
        if held.up is not None:
            current = torch.cuda.current_stream(held.device)
            waiting = timing_event(current)
            current.wait_event(held.up)
            self._wait_spans.append((waiting, timing_event(current)))
            data.record_stream(current)
        for earlier in range(held.index - 1, max(-1, held.index - 1 - self.prefetch), -1):
            ahead = self._packed[earlier]() if earlier < len(self._packed) else None
            if ahead is not None and ahead.gpu is None and ahead.device.type == "cuda":
                self._bring_up(ahead)
        held.gpu = None  # the graph holds what it needs from here
        dtype, shape, stride, contiguous = held.meta
        out = data.view(dtype).view(shape)
        if not contiguous:  # the strides it was saved with
            out = torch.empty_strided(shape, stride, dtype=dtype, device=held.device).copy_(out)
        return out

    def _bring_up(self, held: _Held) -> None:
        if held.device.type != "cuda":
            held.gpu = held.host.clone()
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(held.down)
            gpu = torch.empty(held.host.numel(), dtype=torch.uint8, device=held.device)
            started = timing_event(self._stream)
            gpu.copy_(held.host, non_blocking=True)
            held.up = timing_event(self._stream)
        self._copy_spans.append((started, held.up))
        held.gpu = gpu

    # ---- the pinned pool ---------------------------------------------------------------

    def _buffer(self, nbytes: int, t: torch.Tensor, pin: bool) -> torch.Tensor:
        free = self._free.get((nbytes, pin))
        if free:
            buffer, uploaded = free.pop()
            if uploaded is not None:
                uploaded.synchronize()
            return buffer
        if self.budget_bytes is not None and self._held_bytes + nbytes > self.budget_bytes:
            raise ResourceExhausted(
                f"activation offload: a saved {tuple(t.shape)} {t.dtype} tensor of {nbytes} bytes "
                f"would take the pinned host memory for activations to "
                f"{self._held_bytes + nbytes} bytes, over zoffload.budgets.activation_host_bytes "
                f"({self.budget_bytes}); raise it, checkpoint fewer blocks, or shorten the "
                f"sequence")
        self._held_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def _release(self, host: torch.Tensor, nbytes: int) -> None:
        # The handle is gone (its backward ran, or the graph was dropped): the buffer is free
        # once any upload from it is done (an event recorded after it on the side stream).
        done = None
        if self._stream is not None:
            done = torch.cuda.Event()
            done.record(self._stream)
        self._free.setdefault((nbytes, host.is_pinned()), []).append((host, done))

    def take_seconds(self) -> Tuple[float, float]:
        """The copies' GPU time since the last call, and the compute stream's time waiting for
        them (the part not hidden), in seconds; waits for those copies to finish."""
        spans = self._copy_spans + self._wait_spans
        if spans:
            spans[-1][1].synchronize()
            for _, end in spans:
                end.synchronize()

        def total(pairs: List[Tuple[Any, Any]]) -> float:
            return sum(a.elapsed_time(b) for a, b in pairs) / 1e3

        taken = (total(self._copy_spans), total(self._wait_spans))
        self._copy_spans, self._wait_spans = [], []
        return taken

    @property
    def host_bytes(self) -> int:
        """Host memory the pool holds (in use or free)."""
        return self._held_bytes

    # ---- where the hooks apply ---------------------------------------------------------

    @contextlib.contextmanager
    def saved_tensors(self):
        """The hooks, for the tensors a checkpoint saves inside this block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def wrap(self, checkpoint: Callable) -> Callable:
        """``checkpoint`` with its saved inputs offloaded."""
        if getattr(checkpoint, "_zoffload_activations", None) is self:
            return checkpoint

        @functools.wraps(checkpoint)
        def offloaded(*args: Any, **kwargs: Any) -> Any:
            with self.saved_tensors():
                return checkpoint(*args, **kwargs)

        offloaded._zoffload_activations = self  # type: ignore[attr-defined]
        offloaded._zoffload_original = checkpoint  # type: ignore[attr-defined]
        return offloaded

    def install(self, model: Optional[torch.nn.Module] = None) -> None:
        """Offloads through ``torch.utils.checkpoint.checkpoint`` as looked up at call time,
        and through `model`'s HuggingFace layers' ``_gradient_checkpointing_func`` (wrapped
        again before each forward, as enabling checkpointing after this sets a new one)."""
        if self._torch_checkpoint is None:
            self._torch_checkpoint = torch.utils.checkpoint.checkpoint
            torch.utils.checkpoint.checkpoint = self.wrap(self._torch_checkpoint)
        if model is not None and id(model) not in self._wrapped:
            self._wrap_layers(model)
            hook = model.register_forward_pre_hook(lambda m, _args: self._wrap_layers(m))
            self._wrapped[id(model)] = hook.remove

    def __enter__(self) -> "ActivationOffload":
        """``with ActivationOffload(...) as offload:`` installs it (torch's checkpoint; call
        install(model) for a HuggingFace model's layers) until the block ends."""
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        """Puts every checkpoint function back."""
        if self._torch_checkpoint is not None:
            torch.utils.checkpoint.checkpoint = self._torch_checkpoint
            self._torch_checkpoint = None
        for remove in self._wrapped.values():
            remove()
        self._wrapped.clear()

    def _wrap_layers(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            func = module.__dict__.get("_gradient_checkpointing_func")
            if func is not None and getattr(func, "_zoffload_activations", None) is not self:
                module._gradient_checkpointing_func = self.wrap(func)
