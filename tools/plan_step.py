"""The memory plan's step: the recipe's training step on one rank's layout, its live tensor bytes tracked (the
second step, which carries AdamW's state: the run's peak)."""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
from torch._guards import active_fake_mode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from core.exact_loss import forward_exact
from core.kernel.loss import forward
from core.kernel.train import metrics
from core.schedules import TokenLoss
from tools.plan_layout import EXACT_LOSS, Layout, held_bytes


class PlanAdamW(torch.optim.AdamW):
    """AdamW whose step makes the state and temporaries torch's step makes (per parameter, or foreach on GPUs)."""

    def __init__(self, params, *, foreach: bool):
        super().__init__(params, lr=1e-3)
        self.plan_foreach = foreach

    @torch.no_grad()
    def step(self, closure=None):
        trained = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        for p in trained:  # every trained parameter, as torch's first step leaves them (each gets a gradient)
            if not self.state[p]:  # torch's _init_group: a float32 scalar step, two moments like the parameter
                self.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        params = [p for p in trained if p.grad is not None]
        if params:  # sqrt(exp_avg_sq) (/ bias_correction): of every parameter at once (foreach), or of each in turn
            largest = max(params, key=lambda p: p.numel())
            temporaries = [torch.empty_like(p) for p in (params if self.plan_foreach else [largest, largest])]
            del temporaries
        return None


class LiveBytes(TorchDispatchMode):
    """The bytes of live tensor storages and their peak, as torch's MemTracker counts them, without its import's
    second of CPU (the launchers' pre-check plans before every job); the tests hold the two together."""

    def __init__(self, *, unit: int = 1) -> None:
        super().__init__()
        self.unit, self.now, self.peak = unit, 0, 0
        self.sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self.refs: dict[int, weakref.ref] = {}

    def _bytes(self, storage) -> int:
        return -(-storage.nbytes() // self.unit) * self.unit

    def add(self, *tensors) -> None:
        """Count these tensors' storages (once each), made before the tracker started."""
        for t in tensors:
            for storage in _storages(t):
                key = id(storage)
                if key in self.sizes:
                    self._resized(storage)
                    continue
                self.sizes[key] = self._bytes(storage)
                self.refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
                self.now += self.sizes[key]
        self.peak = max(self.peak, self.now)

    def _freed(self, key: int, _ref) -> None:
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def _resized(self, storage) -> None:
        key, size = id(storage), self._bytes(storage)
        if key in self.sizes and self.sizes[key] != size:
            self.now += size - self.sizes[key]
            self.sizes[key] = size
            self.peak = max(self.peak, self.now)

    def __enter__(self):
        self._entry_fake = active_fake_mode()
        self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):  # FSDP2 frees and refills its gathered parameters by resizing storages
            self._resize(storage, size)
            self._resized(storage)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # DTensor turns into local ops first: those are counted
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            out = args[0]  # fake wait_tensor makes a new tensor where eager returns its input
        else:
            out = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._entry_fake:  # not DTensor's own shape propagation
            self.add(*pytree.tree_leaves(out))
        return out


def _storages(t) -> list:
    """A tensor's storages: its own, or, for a wrapper subclass (DTensor), its inner tensors'."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    return [t.untyped_storage()]


def planned_steps(name: str, layout: Layout, micro_batches: list, *, cfg, loss_fn, gpu: bool, order=None) -> dict:
    """The recipe's step on fake tensors, tracked: its peak, the most the forwards keep for their backwards, and
    the bytes of the gradients and of AdamW's state it leaves."""
    optimizer = PlanAdamW(layout.params, foreach=gpu)  # torch's AdamW takes foreach on GPUs
    tracker = LiveBytes(unit=512 if gpu else 1)  # CUDA's caching allocator hands out multiples of 512 bytes
    held = [t for m in layout.modules for t in (*m.parameters(), *m.buffers())]
    tracker.add(*held, *tensors(micro_batches))
    tracker.add(*(t for bufs in (*layout.recv.values(), *layout.grad_recv.values()) for t in bufs))
    buckets = torch.empty(layout.bucket_bytes, dtype=torch.uint8) if layout.bucket_bytes else None
    tracker.add(*([buckets] if buckets is not None else []))  # the reducer's: made when DDP wraps the model
    held_for_backward = [0]

    def after_forward() -> None:  # what the forwards keep for their backwards: the live bytes beyond the step's start
        grads = held_bytes([p.grad for p in layout.params if p.grad is not None])  # an earlier micro-batch's
        held_for_backward[0] = max(held_for_backward[0], tracker.now - start - grads)

    with tracker:
        optimizer.step()  # no gradients yet: the state alone, as the first step leaves it
        start = tracker.now
        if name == "pipeline":
            pipeline_step(layout, micro_batches, cfg=cfg, order=order, after_forward=after_forward)
        else:
            micro_steps(name, layout, micro_batches, loss_fn=loss_fn, after_forward=after_forward)
        optimizer.step()
    grads = [p.grad for p in layout.params if p.grad is not None]  # as the step left them: shards, or whole
    state = [t for s in optimizer.state.values() for t in s.values()]
    return {
        "grads_bytes": held_bytes(grads),
        "optimizer_bytes": held_bytes(state),
        "activations_bytes": held_for_backward[0],
        "peak_bytes": tracker.peak,
    }


def _autocast(precision: str):
    """step_amp's (and step_pipeline's) autocast on the CPU: the forward in bf16/fp16, nothing for fp32."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)  # as core.accum.step_amp's
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def micro_steps(name: str, layout: Layout, micro_batches: list, *, loss_fn, after_forward=lambda: None) -> None:
    """accum.step_amp's forwards and backwards (or the kernel's step_plain's one), without reading any value."""
    step = functools.partial(forward_exact, normalizer=torch.ones(())) if name in EXACT_LOSS else forward
    for i, batch in enumerate(micro_batches):
        with layout.sync(layout.model, enabled=i == len(micro_batches) - 1):
            with _autocast(layout.autocast):
                loss, _ = step(layout.model, batch, loss_fn)
            after_forward()
            loss.backward()


def pipeline_step(layout: Layout, micro_batches: list, *, cfg, order: list[tuple], after_forward=lambda: None) -> None:
    """One schedule step on this rank's stages, in the schedule's order, keeping what PipelineStage keeps as long."""
    inputs, targets = (torch.cat(parts) for parts in zip(*micro_batches))
    count = max(b for _, _, b in order) + 1
    xs, ys = inputs.chunk(count), targets.chunk(count)
    last = layout.num_stages - 1
    loss_fn, cache, outputs = TokenLoss(), {}, []
    for buffer in (b for bufs in layout.recv.values() for b in bufs):
        buffer.grad = None  # PipelineStage.clear_runtime_states at the step's start
    for kind, stage, mb in order:
        module = dict(layout.stages)[stage]
        if kind == "F":
            x = xs[mb] if stage == 0 else layout.recv[stage][mb]
            with _autocast(layout.autocast):  # step_pipeline's, around the schedule
                out = module(x)
                loss = loss_fn(out, ys[mb]) if stage == last else None
            if stage == last:
                outputs.append(out)
            cache[(stage, mb)] = (out, loss)
            after_forward()
        else:
            out, loss = cache.pop((stage, mb))
            if loss is not None:
                loss.backward()
            else:
                out.backward(layout.grad_recv[stage][mb])
    if outputs:  # the schedule merges the last stage's outputs; step_pipeline's metrics read them
        metrics(torch.cat(outputs), targets, torch.zeros(()), samples=len(targets), shift=False)


def tensors(batch) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(batch) if torch.is_tensor(t)]


def quiet():
    """fully_shard's warnings about views: the plan builds, it does not edit outputs in place."""
    return warnings.catch_warnings(action="ignore")
