"""PyTorch front of zoffload: ``OffloadOptimizer``, a drop-in ``torch.optim.Optimizer``.

Two lines change in a training loop::

    opt = zoffload.torch.OffloadOptimizer(model.named_parameters(), config="ds_config.json")
    ...                                   # forward, loss.backward(), opt.step(), opt.zero_grad()

How it works:
1. Each parameter gets a post-accumulate-grad hook (torch >= 2.1). The hook hands the gradient
   to the engine, on the current CUDA stream, and drops it (``param.grad = None``): the engine
   has copied it into its GPU ring, so no full set of gradients ever sits in GPU memory.
2. ``step()`` passes each group's lr, betas, eps and weight decay to the engine (an LR
   scheduler's changes included), runs the CPU update, and makes the current stream wait for
   the new parameters, which the engine writes into the model's own tensors.
3. Parameters on CUDA (bf16, fp16 or fp32) use the GPU path; parameters on the CPU (host-only
   mode, no GPU needed) are updated in place.
4. Stage 3 with offload_param "cpu" in one process (``model=`` given): the model holds empty
   parameters; their values live in host memory (pinned), which the engine updates in place,
   and each module copies its own to the device before its forward and its backward and drops
   them after; from the second step on a GPU, the next modules' copies (up to
   stage3_prefetch_bucket_size elements) run on a side stream ahead of use. Parameters below
   stage3_param_persistence_threshold elements stay on the device. From the second step, a
   module used again within stage3_max_reuse_distance elements of other modules' fetches (a
   checkpointed block: its recomputed forward, then its backward) keeps its parameters in
   between, up to stage3_max_live_parameters elements kept at once. So a model whose
   parameters exceed the GPU trains on it. A parameter must be used inside the module that
   holds it (read one elsewhere with ``parameter_values``). With offload_param "nvme" the
   values live on NVMe instead: ZeRO at world size 1 (item 5) keeps them in its tensor store,
   in a host cache of offload_param.max_in_cpu elements, and from the second step reads the
   next modules' values from NVMe ahead of use, in the last step's order; the fetches are
   ZeRO's (no side-stream prefetch; the reuse above applies).
5. ZeRO across ranks (``torch.distributed`` initialized with a world size > 1) partitions the
   work (zero_optimization.stage): each rank keeps 1/N of the optimizer state (stage 1), of the
   gradients (2) and of the parameters (3, fetched per module as above, collectively), over the
   host shared-memory backend (ranks on one machine), or over NCCL when the process group's
   backend is "nccl" (its id sent through torch.distributed; the collectives' host buffers go
   through the GPU). GPU parameters communicate through host memory: gradients go down as they
   are made and new values come up after the step. Over shared memory the same micro-batches
   give the same bits at every world size (world size N, one micro-batch each, equals one
   process taking them as N accumulation steps); over NCCL at world size 2 too.

6. Clipping as training loops write it: ``torch.nn.utils.clip_grad_norm_`` (which Accelerate's
   and the HF Trainer's clipping call) is wrapped while this module is imported. Given
   parameters of a live ``OffloadOptimizer`` (whose gradients the hooks took, so torch would
   see none and return 0), it asks the engine for the step's exact global norm, returns it
   (the real norm in the loop's logs) and has the step clip to ``max_norm``; other parameters
   go to torch's own function. Accelerate's ``Accelerator.clip_grad_norm_`` (its own norm
   over ``p.grad``) is routed the same way when accelerate is loaded before the optimizer is
   made. Overlap "none" only (the other modes update before the norm exists: a clear error
   says so).

fp16: multiply the loss by ``loss_scale`` (or call ``backward(loss)``); overflowing steps are
skipped and counted in ``skipped_steps``.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import _zoffload
from .activations import ActivationOffload, timing_event
from .config import ConfigSource, parsed_config

ParamsArg = Union[Iterable[Tuple[str, torch.nn.Parameter]], Iterable[torch.Tensor], Iterable[dict]]

_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
# The optimizers whose parameters clip_grad_norm_ hands to the engine (the open ones).
_LIVE: "weakref.WeakSet[OffloadOptimizer]" = weakref.WeakSet()
# Parameter offload on a GPU: gradient bytes in pinned host memory waiting to be handed over.
_MAX_PENDING_BYTES = 1 << 30


def _named(items: Iterable[Any], first: int) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append(item)
        elif isinstance(item, torch.Tensor):
            out.append((f"param.{first + i}", item))
        else:
            raise _zoffload.InvalidArgument(
                f"parameter #{first + i}: expected a tensor or a (name, tensor) pair, got "
                f"{type(item).__name__}"
            )
    return out


class OffloadOptimizer(torch.optim.Optimizer):
    """AdamW (or the config's optimizer) with its state off the GPU, updated on the CPU.

    ``params``: ``model.named_parameters()``, plain tensors, or torch-style groups (dicts with
    ``"params"`` and any of lr, betas, eps, weight_decay). ``config``: a DeepSpeed-style config
    (path, JSON string or dict; ``"auto"`` values are filled from the keyword arguments and the
    groups). Keyword arguments give the defaults of every group (else the config's
    ``optimizer.params``).
    """

    def __init__(
        self,
        params: ParamsArg,
        config: ConfigSource = None,
        *,
        lr: Optional[float] = None,
        betas: Optional[Tuple[float, float]] = None,
        eps: Optional[float] = None,
        weight_decay: Optional[float] = None,
        model: Optional[torch.nn.Module] = None,
        **known: Any,
    ) -> None:
        if config is None:  # the optimizer in host memory, every other default
            config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        given = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self._config = parsed_config(config, **given, **known)
        cfg = json.loads(self._config.json)
        p = cfg["optimizer"]["params"]
        defaults = {
            "lr": lr if lr is not None else p["lr"],
            "betas": tuple(betas) if betas is not None else tuple(p["betas"]),
            "eps": eps if eps is not None else p["eps"],
            "weight_decay": weight_decay if weight_decay is not None else p["weight_decay"],
        }
        items = list(params)
        if not items:
            raise _zoffload.InvalidArgument("OffloadOptimizer: no parameters given")
        raw_groups = items if isinstance(items[0], dict) else [{"params": items}]
        groups, names = [], []
        for g in raw_groups:
            if not isinstance(g, dict) or "params" not in g:
                raise _zoffload.InvalidArgument(
                    "OffloadOptimizer: mix of parameter groups (dicts) and parameters"
                )
            named = _named(list(g["params"]), len(names))
            names.extend(named)
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [t for _, t in named]})
        self._names: Dict[int, str] = {}
        seen = set()
        for name, t in names:
            if name in seen or id(t) in self._names:
                raise _zoffload.AlreadyExists(f"OffloadOptimizer: parameter '{name}' is given twice")
            seen.add(name)
            self._names[id(t)] = name
        super().__init__(groups, defaults)
        self._cuda = names[0][1].is_cuda
        for name, t in names:
            if not t.requires_grad:
                raise _zoffload.InvalidArgument(
                    f"OffloadOptimizer: parameter '{name}' does not require grad"
                )
            if t.is_cuda != self._cuda:
                raise _zoffload.InvalidArgument(
                    f"OffloadOptimizer: parameter '{name}' is on {t.device}, "
                    f"'{names[0][0]}' on {names[0][1].device}: all must be on cuda or all on cpu"
                )
        hypers = [self._group_hyper(g) for g in self.param_groups]
        zc = cfg["zero_optimization"]
        world, rank = _world()
        # Stage 3 in one process with offload_param "cpu": the parameters' values live in host
        # memory (pinned with a GPU), which the engine updates in place (its host mode); each
        # module copies its own to the device before use. With offload_param "nvme" they live
        # on NVMe: ZeRO at world size 1 keeps them in its tensor store (a host cache of
        # max_in_cpu elements, read ahead in the last step's order), and each fetch gathers.
        offload = world == 1 and zc["stage"] == 3 and zc["offload_param"]["device"] == "cpu"
        on_nvme = world == 1 and zc["offload_param"]["device"] == "nvme"
        if (world > 1 or offload or on_nvme) and model is None:
            raise _zoffload.InvalidArgument(
                "OffloadOptimizer: zero_optimization.stage 3 with offload_param, or ZeRO across "
                "ranks, needs model= (its modules fetch their parameters before use)"
            )
        # ZeRO (across ranks, or with the parameters on NVMe) with GPU parameters: it works in
        # host memory, so the gradients go there, and (stages 1-2) each rank's parameters are
        # uploaded from there after every step.
        zero = world > 1 or on_nvme
        self._host_grads = offload or (zero and self._cuda)
        self._upload = zero and self._cuda and zc["stage"] < 3
        self._host_values: Dict[str, torch.Tensor] = {}  # the values the optimizer writes
        self._persistent: Dict[str, torch.Tensor] = {}  # stage 3: the ones kept on the device
        self._pending: List[Tuple[str, torch.Tensor, Any]] = []  # gradients on their way
        self._landed: set = set()  # parameters with a gradient sent down this step
        self._pending_bytes = 0
        self._downs: Optional[Any] = None  # the gradients' copies to the host (a CUDA stream)
        self._unregister: Optional[Any] = None  # releases the page-locked block, if any
        if self._host_grads and zero and zc["stage"] == 3:
            # Read once, at creation, into the partitions: plain copies, dropped after.
            self._host_values = {name: t.detach().cpu() for name, t in names}
        elif self._host_grads:
            self._host_values = self._host_copies(names)
        spec = []
        for gi, g in enumerate(self.param_groups):
            for t in g["params"]:
                name = self._names[id(t)]
                spec.append((name, self._host_values.get(name, t.detach()), gi))
        self._engine: Optional[_zoffload.Engine] = None
        self._zero: Optional[_zoffload.Zero] = None
        self._fetch_hooks: List[Any] = []
        if zero:
            run, nccl_id, device = _bootstrap(rank) if world > 1 else (_run_name(), "", 0)
            self._zero = _zoffload.Zero(
                self._config, spec, hypers, run, rank, world, nccl_id, device
            )
            if zc["stage"] == 3:  # read at creation only: the partitions hold them now
                self._host_values = {}
        else:
            self._engine = _zoffload.Engine(self._config, spec, hypers)
        # Gradients through host memory from a GPU: each one's D2H goes straight into the
        # optimizer's own pinned memory for it, which takes it in place (no host copy of every
        # gradient), where it can (the engine: not with accumulation or overlap "delayed";
        # ZeRO: one rank, one micro-batch).
        self._grad_buffers: Dict[str, torch.Tensor] = {}
        if self._host_grads and self._cuda:
            for name, t in names:
                buffer = (self._zero or self._engine).gradient_buffer(name)
                if buffer is not None:
                    self._grad_buffers[name] = torch.from_numpy(buffer).view(t.dtype).view(t.shape)
        self._partitioned = offload or (zero and zc["stage"] == 3)
        # The parameters whose own memory the engine writes (held by the engine too): the
        # storage each had here. A parameter given other storage later (p.data = ...,
        # model.share_memory(), model.to(...)) would be left behind: checked at each gradient
        # and step, and refused naming it.
        self._storage: Dict[str, int] = {} if self._partitioned else {
            name: t.data_ptr() for name, t in names if name not in self._host_values
        }
        self._collective = world > 1  # every fetch a collective: no reuse
        if self._partitioned:
            self._fetch_per_module(model, zc)
        self._sent = hypers
        self._closed = False
        self._skipped = 0
        # activation_checkpointing.cpu_checkpointing: the checkpoints' saved inputs in host
        # memory (torch's checkpoint, and model's HuggingFace layers).
        self.activations: Optional[ActivationOffload] = None
        if cfg["activation_checkpointing"]["cpu_checkpointing"]:
            zs = cfg["zoffload"]
            self.activations = ActivationOffload(zs["activation_min_bytes"],
                                                 zs["budgets"].get("activation_host_bytes"))
            self.activations.install(model)
        self._last_activation_seconds = (0.0, 0.0)
        self._hooks = [
            t.register_post_accumulate_grad_hook(self._make_hook(self._names[id(t)]))
            for g in self.param_groups
            for t in g["params"]
        ]
        _LIVE.add(self)
        _route_accelerate()

    @staticmethod
    def _group_hyper(group: dict) -> dict:
        return {k: (tuple(group[k]) if k == "betas" else float(group[k])) for k in _GROUP_KEYS}

    def _make_hook(self, name: str):
        # A weak reference: the parameter holds the hook, and the optimizer its parameters.
        this = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            opt = this()
            if grad is None or opt is None:
                return
            opt._check_storage(name, param)
            opt._sync_groups()  # overlap "backward" updates with the groups as they are now
            if opt._host_grads:  # the engine's host mode, or ZeRO with GPU parameters
                opt._to_host(name, grad.detach())
            elif opt._zero is not None:
                opt._zero.gradient_ready(name, grad.detach().contiguous())
            else:
                opt._engine.gradient_ready(name, grad.detach(), opt._stream())
            param.grad = None  # the engine has its copy
            if opt._partitioned and name not in opt._persistent:
                param.data = _empty_like(param)

        return hook

    def _check_storage(self, name: str, param: torch.Tensor) -> None:
        if self._closed:
            raise _zoffload.FailedPrecondition(
                f"OffloadOptimizer: used after close() (parameter '{name}')"
            )
        registered = self._storage.get(name)
        if registered is not None and param.data_ptr() != registered:
            raise _zoffload.FailedPrecondition(
                f"OffloadOptimizer: parameter '{name}' now lives in other memory than when the "
                "optimizer was built (p.data = ..., model.share_memory() or model.to(...) after "
                "it): the optimizer updates the old memory. Build the optimizer after moving or "
                "re-assigning the model's parameters."
            )

    def _host_copies(self, names: List[Tuple[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Host copies of the parameters' values. With a GPU they are page-locked, all in one
        block of their exact size registered with CUDA (torch's pinned allocator would round
        each tensor up to a power of two: up to twice the memory); if registering fails (a
        memlock limit), torch's pinned tensors, with a warning."""
        aligned = [(n, t, (t.numel() * t.element_size() + 63) // 64 * 64) for n, t in names]
        block = None
        if torch.cuda.is_available():
            block = torch.empty(sum(size for _, _, size in aligned), dtype=torch.uint8)
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
                    block.data_ptr(), block.numel(), 0))
                # Unregistered on close(), or when the optimizer is collected without it.
                self._unregister = weakref.finalize(self, _unregister, block)
                self._unregister.atexit = False  # the process's end releases it anyway
            except Exception as e:  # noqa: BLE001 - any refusal: fall back, and say so
                warnings.warn(f"zoffload: page-locking {block.numel()} bytes of parameter "
                              f"values failed ({e}); using torch's pinned memory (rounded up "
                              "to powers of two). Raise `ulimit -l` to avoid this.")
                block = None
        copies, at = {}, 0
        for name, t, size in aligned:
            if block is not None:
                nbytes = t.numel() * t.element_size()
                values = block[at:at + nbytes].view(t.dtype).view(t.shape)
                at += size
            else:
                values = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            values.copy_(t.detach())
            copies[name] = values
        return copies

    def _to_host(self, name: str, grad: torch.Tensor) -> None:
        """The gradient to pinned host memory (the engine's own for it, where the engine takes
        it in place), then to the engine (host mode) or ZeRO. On a GPU
        the copy is asynchronous and the gradient is handed over once it has landed (checked at
        each later gradient, waited for when more than _MAX_PENDING_BYTES are on their way, and
        in step()), so the host keeps the GPU fed meanwhile. (Under ZeRO the hand-overs are
        collective: every rank makes them in the same order, whenever its copies land.)"""
        if not grad.is_cuda:
            self._hand(name, grad.contiguous())
            return
        # The engine's own buffer takes a step's first gradient in place; a later micro-batch's
        # (accumulation by repeated backward) is added into it, so it lands elsewhere.
        host = None if name in self._landed else self._grad_buffers.get(name)
        self._landed.add(name)
        if host is None:
            host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        # On a stream of its own, after the work that made the gradient, so that backward's
        # kernels need not queue behind the copy (the gradient's memory waits for it).
        if self._downs is None:
            self._downs = torch.cuda.Stream(grad.device)
        self._downs.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._downs):
            host.copy_(grad, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
        grad.record_stream(self._downs)
        self._pending.append((name, host, landed))
        self._pending_bytes += host.numel() * host.element_size()
        self._hand_over(wait=self._pending_bytes > _MAX_PENDING_BYTES)

    def _hand_over(self, wait: bool) -> None:
        """Hands the landed gradients to the engine, in order; `wait`: all of them."""
        while self._pending and (wait or self._pending[0][2].query()):
            name, host, landed = self._pending.pop(0)
            landed.synchronize()
            self._hand(name, host)
            self._pending_bytes -= host.numel() * host.element_size()

    def _hand(self, name: str, host: torch.Tensor) -> None:
        if self._zero is not None:
            self._zero.gradient_ready(name, host)
        else:
            self._engine.gradient_ready(name, host, 0)

    def _upload_values(self) -> None:
        """ZeRO stages 1-2 with GPU parameters: the step's new values into the model."""
        for g in self.param_groups:
            for t in g["params"]:
                t.data.copy_(self._host_values[self._names[id(t)]], non_blocking=True)

    def _fetch_per_module(self, model: torch.nn.Module, zc: Dict[str, Any]) -> None:
        """Stage 3: the model keeps empty parameters; each module fetches its own (those
        registered here) before its forward and its backward and drops them after its forward
        (after backward, as each gradient is handed over). Under ZeRO a fetch is collective."""
        self._shapes: Dict[str, torch.Size] = {}
        # GPU prefetch: the order of module fetches in the first step, the position in it,
        # the copies started ahead (module -> (values, event)) and their stream.
        self._order: List[Tuple[int, List[Tuple[str, torch.Tensor]]]] = []
        self._recording = True
        self._cursor = self._ahead = 0  # the next module to use, the next to prefetch
        self._prefetch_elements = zc["stage3_prefetch_bucket_size"]
        self._prefetched: Dict[int, Tuple[List[torch.Tensor], Any]] = {}
        self._copies: Optional[Any] = None
        # Reuse (one process): from the recorded order, each position's next use of the same
        # module and the elements fetched before each position; the modules kept (elements) and
        # where each module was last fetched. Fetches of this step: count and elements.
        self._reuse_distance = zc["stage3_max_reuse_distance"]
        self._max_live = zc["stage3_max_live_parameters"]
        self._next_use: List[int] = []
        self._prev_use: List[int] = []
        self._fetched_before: List[int] = []
        self._kept: Dict[int, Tuple[int, List[Tuple[str, torch.Tensor]]]] = {}
        self._last_at: Dict[int, int] = {}
        self._fetches = self._fetched_elements = 0
        self._last_fetches = (0, 0)
        # On a GPU, timing events around this step's parameter copies (on whichever stream)
        # and around the compute stream's waits for them; their sums at the last step.
        self._copy_spans: List[Tuple[Any, Any]] = []
        self._wait_spans: List[Tuple[Any, Any]] = []
        self._last_copy_seconds = (0.0, 0.0)
        # Parameters below stage3_param_persistence_threshold elements stay on the device (a
        # copy per use would cost more than it saves); step() refreshes them.
        threshold = zc["stage3_param_persistence_threshold"]
        for g in self.param_groups:
            for t in g["params"]:
                name = self._names[id(t)]
                self._shapes[name] = t.shape
                if t.numel() < threshold:
                    self._persistent[name] = t
                else:
                    t.data = _empty_like(t)
        this = weakref.ref(self)
        for module in model.modules():
            own = [(self._names[id(p)], p) for p in module.parameters(recurse=False)
                   if id(p) in self._names and self._names[id(p)] not in self._persistent]
            if not own:
                continue

            def fetch(*_: Any, own=own, key=id(module)) -> None:
                opt = this()
                if opt is not None:
                    opt._fetch_module(key, own)

            def drop(*_: Any, own=own, key=id(module)) -> None:  # backward fetches them again
                opt = this()
                if opt is None or not opt._keep(key, own):
                    _drop(own)

            self._fetch_hooks += [
                module.register_forward_pre_hook(fetch),
                module.register_forward_hook(drop),
                module.register_full_backward_pre_hook(fetch),
            ]

    def _refresh_persistent(self) -> None:
        """Stage 3: the new values of the parameters that stay on the device."""
        for name, p in self._persistent.items():
            if self._zero is not None:
                values = torch.empty(p.shape, dtype=p.dtype)
                self._zero.gather(name, values.view(-1))
                p.data.copy_(values)
            else:
                p.data.copy_(self._host_values[name], non_blocking=True)

    def _keep(self, key: int, own: List[Tuple[str, torch.Tensor]]) -> bool:
        """After a module's forward: whether its parameters stay until its next use (that use
        comes within stage3_max_reuse_distance elements of other fetches, and the modules kept
        stay within stage3_max_live_parameters elements). One process only: across ranks
        every fetch is collective."""
        at = self._last_at.get(key)
        if self._collective or self._recording or at is None:
            return False
        size = sum(p.numel() for _, p in own)
        kept = sum(size for size, _ in self._kept.values())
        if not self._reusable(at, self._next_use[at]) or kept + size > self._max_live:
            return False
        self._kept[key] = (size, own)
        return True

    def _reusable(self, at: int, then: int) -> bool:
        """Whether the module used at position `at` of the recorded order, used next at
        `then` (-1: never), may keep its parameters in between."""
        if then < 0:
            return False
        size = self._fetched_before[at + 1] - self._fetched_before[at]
        between = self._fetched_before[then] - self._fetched_before[at + 1]
        return between <= self._reuse_distance and size <= self._max_live

    def _release_kept(self) -> None:
        for _, own in self._kept.values():
            _drop(own)
        self._kept.clear()

    def _end_recording(self) -> None:
        """The first step's order is known: where each module is used next and was used
        before, and the elements fetched before each position."""
        self._recording = False
        last: Dict[int, int] = {}
        self._next_use = [-1] * len(self._order)
        self._prev_use = [-1] * len(self._order)
        for i in range(len(self._order) - 1, -1, -1):
            key = self._order[i][0]
            self._next_use[i] = last.get(key, -1)
            if self._next_use[i] >= 0:
                self._prev_use[self._next_use[i]] = i
            last[key] = i
        self._fetched_before = [0]
        for _, own in self._order:
            self._fetched_before.append(
                self._fetched_before[-1] + sum(self._shapes[name].numel() for name, _ in own))

    def _fetch_module(self, key: int, own: List[Tuple[str, torch.Tensor]]) -> None:
        """A module's parameters onto their device, unless they are there (kept since its last
        use, or not yet dropped: a checkpointed block's backward starts by recomputing its
        forward). The modules' order of use is recorded in the first step; from then on, on a
        GPU, each fetch also starts the next module's copies on a side stream, so that they run
        under this module's compute."""
        prefetched = self._prefetched.pop(key, None)
        self._kept.pop(key, None)
        present = all(p.numel() == self._shapes[name].numel() for name, p in own)
        if present:
            prefetched = None
        elif prefetched is not None:
            values, copied = prefetched
            stream = torch.cuda.current_stream()
            waited = timing_event(stream)
            stream.wait_event(copied)
            self._wait_spans.append((waited, timing_event(stream)))
            for (_, p), v in zip(own, values):
                v.record_stream(stream)
                p.data = v
        else:
            # Copies at their use, on the compute stream: it waits for all of them.
            started = timing_event() if own[0][1].is_cuda else None
            for name, p in own:
                p.data = self._fetch(name, p)
            if started is not None:
                span = (started, timing_event())
                self._copy_spans.append(span)
                self._wait_spans.append(span)
        if not present:
            self._fetches += 1
            self._fetched_elements += sum(self._shapes[name].numel() for name, _ in own)
        if self._collective:
            return
        if self._recording:
            self._last_at[key] = len(self._order)
            self._order.append((key, own))
            return
        at = self._cursor
        if at >= len(self._order) or self._order[at][0] != key:
            # The model ran otherwise than in the first step: no prefetch or reuse this step.
            self._prefetched.clear()
            self._last_at.clear()
            self._cursor = self._ahead = len(self._order)
            return
        self._last_at[key] = at
        self._cursor += 1
        if self._prefetch_elements == 0 or not own[0][1].is_cuda or self._zero is not None:
            # Prefetching off (each copy starts at its use), nothing to prefetch to, or the
            # values are on NVMe (ZeRO reads them ahead itself).
            return
        # The next modules' copies, up to stage3_prefetch_bucket_size elements in flight (at
        # least the next module's).
        self._ahead = max(self._ahead, self._cursor)
        in_flight = sum(v.numel() for values, _ in self._prefetched.values() for v in values)
        while self._ahead < len(self._order):
            next_key, next_own = self._order[self._ahead]
            size = sum(self._host_values[name].numel() for name, _ in next_own)
            if self._ahead > self._cursor and in_flight + size > self._prefetch_elements:
                break
            # A module used twice in the window: its first use; one kept since its last use
            # (its previous use is this one or later): no copy.
            prev = self._prev_use[self._ahead]
            reused = next_key in self._kept or (
                prev >= self._cursor - 1 and self._reusable(prev, self._ahead))
            if next_key not in self._prefetched and not reused:
                self._prefetch(next_key, next_own)
                in_flight += size
            self._ahead += 1

    def _prefetch(self, key: int, own: List[Tuple[str, torch.Tensor]]) -> None:
        # The copies read host values that nothing writes while they can run (the engine writes
        # a parameter's only after its last use in the step, or in step(), which waits for
        # them), into new memory of their own stream: they need not wait for the compute queued.
        if self._copies is None:
            self._copies = torch.cuda.Stream(own[0][1].device)
        with torch.cuda.stream(self._copies):
            started = timing_event()
            values = [self._host_values[name].to(p.device, non_blocking=True) for name, p in own]
            copied = timing_event()
        self._copy_spans.append((started, copied))
        self._prefetched[key] = (values, copied)

    def _take_copy_seconds(self) -> Tuple[float, float]:
        """This step's parameter copies on the GPU: their time, and the compute stream's time
        waiting for them (seconds, from the timing events; step() has synchronized the device,
        as the gradients go to host memory wherever parameters are fetched on a GPU)."""
        def total(spans: List[Tuple[Any, Any]]) -> float:
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        taken = (total(self._copy_spans), total(self._wait_spans))
        self._copy_spans, self._wait_spans = [], []
        return taken

    def _fetch(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """Parameter `name`'s current values, on the device of the (empty) parameter `p`: the
        model may be moved (model.to) after the optimizer took its parameters."""
        if self._zero is not None:
            # Across ranks a gather is collective, and so is a hand-over that fills a gradient
            # bucket: hand over every gradient of this rank first, so that all ranks call them
            # in one order (the copies land at different times on each).
            if self._collective:
                self._hand_over(wait=True)
            values = torch.empty(self._shapes[name], dtype=p.dtype, pin_memory=p.is_cuda)
            self._zero.gather(name, values.view(-1))
            return values.to(p.device, non_blocking=True)
        # Pinned host memory: an asynchronous copy on the current stream (the engine writes
        # these values only after the gradient's copy to the host, which follows it on the
        # stream and waits, or in step(), which waits for every copy first).
        return self._host_values[name].to(p.device, non_blocking=True)

    def parameter_values(self, name: str) -> torch.Tensor:
        """A parameter's current values (a copy, on the parameter's device): the way to read a
        stage-3 parameter outside its module (collective under ZeRO)."""
        p = next((t for g in self.param_groups for t in g["params"] if self._names[id(t)] == name),
                 None)
        if p is None:
            raise _zoffload.NotFound(f"OffloadOptimizer: no parameter '{name}'")
        if not self._partitioned or name in self._persistent:
            return p.detach().clone()
        return self._fetch(name, p).clone()

    @property
    def engine(self) -> _zoffload.Engine:
        """The C++ engine (read_state, host_bytes, ...); across ranks see ``zero``."""
        if self._engine is None:
            raise _zoffload.FailedPrecondition(
                "OffloadOptimizer: this run uses ZeRO across ranks (see .zero), not the engine"
            )
        return self._engine

    @property
    def zero(self) -> Optional[_zoffload.Zero]:
        """The ZeRO optimizer of this rank, when the run partitions (else None)."""
        return self._zero

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale to multiply the loss by (1 without fp16)."""
        return (self._zero or self._engine).loss_scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/NaN gradients (fp16 overflow)."""
        return self._skipped

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * loss_scale).backward()``."""
        scale = self.loss_scale
        (loss * scale if scale != 1 else loss).backward()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for this optimizer's parameters, whose gradients
        the engine holds: the global L2 norm of this step's gradients (a float32 tensor on the
        parameters' device), and the next ``step()`` clips to ``max_norm`` (``inf``: the norm
        alone, the clipping left as it is). Call it after the last backward of the step, as
        torch's. Overlap "none" only."""
        if float(norm_type) != 2.0:
            raise _zoffload.Unimplemented(
                f"OffloadOptimizer.clip_grad_norm_: norm_type {norm_type}; zoffload clips by the "
                "L2 norm (2.0)"
            )
        if self._zero is not None:
            raise _zoffload.Unimplemented(
                "OffloadOptimizer.clip_grad_norm_: not under ZeRO yet; set the config's "
                "gradient_clipping instead (the step clips with the exact global norm)"
            )
        if self._host_grads:
            self._hand_over(wait=True)
        if not math.isinf(float(max_norm)):
            self._engine.set_gradient_clipping(float(max_norm))
        norm = self._engine.gradient_norm()
        return torch.tensor(norm, dtype=torch.float32,
                            device=self.param_groups[0]["params"][0].device)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """The optimizer step over the gradients handed over since the last one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for t in g["params"]:
                self._check_storage(self._names[id(t)], t)
        self._sync_groups()
        if self._host_grads:
            self._hand_over(wait=True)
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the copies still reading the host values
        if self._partitioned:  # the order of use is known after the first step
            if self._recording:
                self._end_recording()
            self._cursor = self._ahead = 0
            self._prefetched.clear()
            self._release_kept()
            self._last_at.clear()
            self._last_fetches = (self._fetches, self._fetched_elements)
            self._fetches = self._fetched_elements = 0
            self._last_copy_seconds = self._take_copy_seconds()
        if self.activations is not None:
            self._last_activation_seconds = self.activations.take_seconds()
        self._landed.clear()
        if self._zero is not None:
            stats = self._zero.step()
        else:
            stats = self._engine.step()
            self._engine.wait_parameters(self._stream())
        if self._upload:
            self._upload_values()
        self._refresh_persistent()
        if stats["skipped"]:
            self._skipped += 1
        self._last = stats
        return loss

    def flush(self) -> None:
        """With ``zoffload.overlap`` "delayed" the model holds the parameters of one step
        before the last; this waits for the update still running and puts the last step's
        parameters into the model (state_dict and close do it too). A no-op otherwise."""
        if self._engine is not None:
            self._engine.flush(self._stream())
            self._engine.wait_parameters(self._stream())

    def _sync_groups(self) -> None:
        for i, g in enumerate(self.param_groups):
            hyper = self._group_hyper(g)
            if hyper != self._sent[i]:
                (self._zero or self._engine).set_group(i, hyper)
                self._sent[i] = hyper

    def _stream(self) -> int:
        """The current CUDA stream of the parameters' device (0 in host mode)."""
        if not self._cuda:
            return 0
        return torch.cuda.current_stream(self.param_groups[0]["params"][0].device).cuda_stream

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are dropped as the engine takes them; this clears any left over."""
        for g in self.param_groups:
            for t in g["params"]:
                t.grad = None

    def stats(self) -> dict:
        """The last step's phase times, bytes moved, grad norm, loss scale and skip flag; with
        parameters fetched per module (stage 3), also ``parameter_fetches`` (module fetches
        that copied) and ``parameter_fetch_elements`` of that step, and on a GPU
        ``parameter_copy_seconds`` (the GPU time of those copies) and
        ``parameter_copy_exposed_seconds`` (the compute stream's time waiting for them: the
        part not hidden under compute). Under ``zoffload.overlap`` "backward", ``speculation``
        says how the update ran: "committed" (made during backward and kept), "redone" (made
        during backward, then undone and made exactly after it: clipping, inf/NaN) or "exact"
        (after backward only, as the last step clipped or overflowed), with
        ``speculation_why`` and ``speculated_elements``. With
        ``activation_checkpointing.cpu_checkpointing``, the activations offloaded so far
        (``activations_offloaded``, ``activation_bytes_offloaded``), those found on the GPU
        when backward needed them (``activations_prefetched``) and the host memory held for
        them (``activation_host_bytes``), and on a GPU the last step's copies' GPU time
        (``activation_copy_seconds``) and the compute stream's time waiting for them
        (``activation_copy_exposed_seconds``)."""
        last = getattr(self, "_last", {}) if self._zero is not None else self._engine.last_step
        if self._partitioned:
            fetches, elements = self._last_fetches
            copy, exposed = self._last_copy_seconds
            last = {**last, "parameter_fetches": fetches, "parameter_fetch_elements": elements,
                    "parameter_copy_seconds": copy, "parameter_copy_exposed_seconds": exposed}
        if self.activations is not None:
            a = self.activations
            last = {**last, "activations_offloaded": a.packed_tensors,
                    "activation_bytes_offloaded": a.packed_bytes,
                    "activations_prefetched": a.prefetched_tensors,
                    "activation_host_bytes": a.host_bytes,
                    "activation_copy_seconds": self._last_activation_seconds[0],
                    "activation_copy_exposed_seconds": self._last_activation_seconds[1]}
        return last

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The optimizer's state: per parameter name its fp32 ``master``, ``exp_avg`` and
        ``exp_avg_sq`` (float32 for fp32 state, the raw bytes for bf16 and int8 state), the
        param groups (parameters by name) and the step count. CPU tensors."""
        self._no_zero_checkpoints()
        self.flush()
        state = {}
        for name in self._ordered_names():
            master, m, v = self._engine.read_state(name)
            state[name] = {
                "master": torch.from_numpy(master),
                "exp_avg": torch.from_numpy(m),
                "exp_avg_sq": torch.from_numpy(v),
            }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [self._names[id(t)] for t in g["params"]]}
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups, "steps": self._engine.steps}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Restores ``state_dict()``'s output: the state of every parameter (the model's
        parameters are set to the masters, in their dtype), the groups' hyperparameters and the
        step count. The parameters must be the same names and sizes."""
        self._no_zero_checkpoints()
        missing = [k for k in ("state", "param_groups", "steps") if k not in state_dict]
        if missing:
            raise _zoffload.InvalidArgument(f"load_state_dict: no {', '.join(missing)}")
        names = self._ordered_names()
        given = state_dict["state"]
        absent = [n for n in names if n not in given]
        extra = [n for n in given if n not in set(names)]
        if absent or extra:
            raise _zoffload.InvalidArgument(
                f"load_state_dict: the state does not match the parameters (missing {absent[:5]}, "
                f"unknown {extra[:5]})"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            list(a["params"]) != [self._names[id(t)] for t in b["params"]]
            for a, b in zip(groups, self.param_groups)
        ):
            raise _zoffload.InvalidArgument(
                "load_state_dict: the param groups differ (their number or their parameters)"
            )
        for name in names:
            st = given[name]
            arrays = [st[k].detach().cpu().contiguous().numpy()
                      for k in ("master", "exp_avg", "exp_avg_sq")]
            self._engine.load_state(name, *arrays)
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self._engine.steps = int(state_dict["steps"])
        self._engine.wait_parameters(self._stream())

    def save(self, directory: Union[str, os.PathLike]) -> None:
        """The optimizer's checkpoint into ``directory`` (written atomically: a crash leaves the
        old checkpoint or the new one): every parameter's fp32 master and moments, the step
        count, the fp16 loss scale and the groups' hyperparameters. Between steps. The model's
        own weights and an LR scheduler's state are the caller's to save. Under ZeRO every rank
        calls it; rank 0 writes whole parameters, so the checkpoint loads at any world size
        (fp32 or bf16 state)."""
        self._sync_groups()  # an LR scheduler's step since the last step() is the groups' state
        self.flush()
        (self._zero or self._engine).save(directory)

    def load(self, directory: Union[str, os.PathLike]) -> None:
        """Restores ``save(directory)`` into this optimizer (same parameter names and sizes):
        the state, the step count, the loss scale and the groups' hyperparameters, and the
        model's parameters are set to the masters. The run continues bit-identically."""
        backend = self._zero or self._engine
        backend.load(directory)
        for i, g in enumerate(self.param_groups):
            saved = backend.group(i)
            g.update({k: (tuple(saved[k]) if k == "betas" else saved[k]) for k in _GROUP_KEYS})
            self._sent[i] = self._group_hyper(g)
        if self._engine is not None:
            self._engine.wait_parameters(self._stream())
        if self._upload:
            self._upload_values()
        self._refresh_persistent()

    def _no_zero_checkpoints(self) -> None:
        if self._zero is not None:
            raise _zoffload.Unimplemented(
                "OffloadOptimizer: state_dict of a ZeRO run (partitioned state) is not supported "
                "yet; save(dir) and load(dir) are"
            )

    def _ordered_names(self) -> List[str]:
        return [self._names[id(t)] for g in self.param_groups for t in g["params"]]

    def close(self) -> None:
        """Removes the hooks and frees the engine's memory now."""
        if self._closed:
            return
        for h in self._hooks + self._fetch_hooks:
            h.remove()
        self._hooks, self._fetch_hooks = [], []
        if self.activations is not None:
            self.activations.uninstall()
        self.flush()
        _LIVE.discard(self)
        self._grad_buffers = {}  # views of the engine's memory
        (self._zero or self._engine).close()
        if self._unregister is not None:
            self._unregister()
        self._closed = True


_TORCH_CLIP_GRAD_NORM = torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """``torch.nn.utils.clip_grad_norm_``, with the parameters of an open ``OffloadOptimizer``
    clipped by it (its ``clip_grad_norm_``: the engine's exact global norm) and any others by
    torch. Installed in place of torch's while zoffload.torch is imported."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(opt): opt for opt in list(_LIVE) for p in params if id(p) in opt._names}
    if not owners:
        return _TORCH_CLIP_GRAD_NORM(params, max_norm, norm_type, error_if_nonfinite, foreach)
    others = [p for p in params
              if p.grad is not None and not any(id(p) in o._names for o in owners.values())]
    if len(owners) > 1 or others:
        raise _zoffload.InvalidArgument(
            "clip_grad_norm_: the parameters mix those of "
            f"{len(owners)} OffloadOptimizer(s) with {len(others)} others that have gradients; "
            "clip each optimizer's parameters on their own"
        )
    norm = next(iter(owners.values())).clip_grad_norm_(max_norm, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"clip_grad_norm_: the gradients' global norm is {norm.item()}, not "
                           "finite, and error_if_nonfinite was asked for")
    return norm


torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def _route_accelerate() -> None:
    """Accelerate (and the HF Trainer through it) clips with its own norm over ``p.grad``, not
    torch's function: when it is loaded, its ``Accelerator.clip_grad_norm_`` hands an
    OffloadOptimizer's parameters to ``clip_grad_norm_`` above (once per process)."""
    accelerate = sys.modules.get("accelerate")
    if accelerate is None or getattr(accelerate.Accelerator.clip_grad_norm_, "_zoffload", False):
        return
    original = accelerate.Accelerator.clip_grad_norm_

    def routed(self, parameters, max_norm, norm_type=2):
        params = list(parameters)
        if any(id(p) in opt._names for opt in list(_LIVE) for p in params):
            return clip_grad_norm_(params, max_norm, norm_type)
        return original(self, params, max_norm, norm_type)

    routed._zoffload = True  # type: ignore[attr-defined]
    accelerate.Accelerator.clip_grad_norm_ = routed


def _world() -> Tuple[int, int]:
    """(world size, rank) of torch.distributed, or (1, 0) when it is not initialized."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _bootstrap(rank: int) -> Tuple[str, str, int]:
    """What the ranks of a ZeRO run share, made by rank 0 and sent to the others in one
    torch.distributed broadcast: the run's name (its shared-memory segment is named after it)
    and, under an NCCL process group, an NCCL id (else ""); with this rank's CUDA device for
    NCCL (else 0)."""
    nccl = torch.distributed.get_backend() == "nccl"
    shared = [(_run_name(), _zoffload.new_nccl_id() if nccl else "") if rank == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    run, nccl_id = shared[0]
    return run, nccl_id, torch.cuda.current_device() if nccl else 0


def _run_name() -> str:
    """A name of a ZeRO run's own (its shared-memory segment is named after it)."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"


def _unregister(block: torch.Tensor) -> None:
    """Unpins a block _host_copies registered, once no copy reads it."""
    torch.cuda.synchronize()
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(block.data_ptr()))


def _drop(own: List[Tuple[str, torch.Tensor]]) -> None:
    """Empties a module's parameters (their values stay in host memory)."""
    for _, p in own:
        p.data = _empty_like(p)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)
