"""The memory plan's step: the recipe's training step on one rank's layout, under torch's MemTracker.

Two steps run, as training runs them: the first creates AdamW's state, the second carries it through the forward
and backward. Under fake tensors AdamW's own step cannot run (it reads its step count as a number), so PlanAdamW
creates what torch's step creates (exp_avg and exp_avg_sq like each parameter, a scalar step) and the temporaries
of its implementation: per parameter on CPU (two of the largest), for all parameters at once with foreach (GPU).
"""

from __future__ import annotations

import contextlib

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from core import amp
from core.exact_loss import forward_exact
from core.loss import forward, metrics
from core.pipeline import TokenLoss
from tools.plan_layout import EXACT_LOSS, Layout


class PlanAdamW(torch.optim.AdamW):
    """AdamW whose step makes the state and temporaries torch's step makes, reading no value (fake tensors)."""

    def __init__(self, params, *, foreach: bool):
        super().__init__(params, lr=1e-3)
        self.plan_foreach = foreach

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:  # torch's _init_group: a float32 scalar step, two moments like the parameter
                self.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        if not params:
            return None
        if self.plan_foreach:  # _multi_tensor_adamw: sqrt(exp_avg_sq) for every parameter at once
            temporaries = [torch.empty_like(p) for p in params]
        else:  # _single_tensor_adamw: sqrt(exp_avg_sq) / bias_correction, one parameter at a time
            largest = max(params, key=lambda p: p.numel())
            temporaries = [torch.empty_like(largest), torch.empty_like(largest)]
        del temporaries
        return None


class StepTracker(MemTracker):
    """torch's MemTracker without its per-module hooks: the same tensors, categories and peak, but no module
    statistics, so a module may run many times in one step (accumulation, a pipeline's micro-batches) and
    pipelining's backward (autograd.grad on its stages' inputs) meets no hook of the tracker's."""

    def __init__(self, modules) -> None:
        super().__init__()
        self._modules = list(modules)

    def __enter__(self) -> StepTracker:
        self._fake_mode_on_entry = active_fake_mode()
        self._register_global_optimizer_hook()
        for module in self._modules:  # gradients counted as gradients, as the module hooks would install
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
        self._track_resize()
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args) -> None:
        self._deregister_param_and_optimizer_hooks()
        self._restore_resize()
        TorchDispatchMode.__exit__(self, *args)


def track(tensors) -> StepTracker:
    """A StepTracker that counts these tensors (modules, optimizers, the batch) made before it starts."""
    tracker = StepTracker(t for t in tensors if isinstance(t, torch.nn.Module))
    tracker.track_external(*tensors)
    return tracker


def peak_of(tracker: MemTracker) -> tuple[int, dict[str, int]]:
    """The tracker's peak over every device, and its categories at the peak (Parameter, Gradient, ...)."""
    total, parts = 0, {}
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        for key, value in snapshot.items():
            name = key if isinstance(key, str) else key.value
            if name == "Total":
                total += value
            else:
                parts[name] = parts.get(name, 0) + value
    return total, parts


def planned_steps(name: str, layout: Layout, micro_batches: list, *, cfg, loss_fn, foreach: bool, order=None):
    """The recipe's step, twice, on fake tensors, tracked; (peak bytes, categories at the peak)."""
    optimizer = PlanAdamW(layout.params, foreach=foreach)
    tensors = [t for b in micro_batches for t in _tensors(b)]
    buffers = [t for bufs in (*layout.recv.values(), *layout.grad_recv.values()) for t in bufs]
    tracker = track([*layout.modules, optimizer, *tensors, *buffers])
    buckets = torch.empty(layout.bucket_bytes, dtype=torch.uint8) if layout.bucket_bytes else None
    if buckets is not None:  # the reducer's buckets: made when DDP wraps the model, kept for the run
        tracker.track_external(buckets)
    with tracker:
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            if name == "pipeline":
                pipeline_step(layout, micro_batches, cfg=cfg, order=order)
            else:
                micro_steps(name, layout, micro_batches, loss_fn=loss_fn)
            optimizer.step()
    return peak_of(tracker)


def micro_steps(name: str, layout: Layout, micro_batches: list, *, loss_fn) -> None:
    """amp.step_amp's forwards and backwards (or core.steps.step_plain's one), without reading any value."""
    exact, normalizer = name in EXACT_LOSS, torch.ones(())
    for i, batch in enumerate(micro_batches):
        with layout.sync(layout.model, enabled=i == len(micro_batches) - 1):
            with amp.autocast(layout.autocast, device=torch.device("cpu")):
                if exact:
                    loss, _ = forward_exact(layout.model, batch, loss_fn, normalizer=normalizer)
                else:
                    loss, _ = forward(layout.model, batch, loss_fn)
            loss.backward()


def pipeline_step(layout: Layout, micro_batches: list, *, cfg, order: list[tuple]) -> None:
    """One schedule step on this rank's stages, in the schedule's order: what torch's PipelineStage keeps (a
    receive buffer per micro-batch for the inputs and for the gradients, every forward's graph until its
    backward, the last stage's outputs until the step returns) is kept here as long."""
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
            with amp.autocast(layout.autocast, device=torch.device("cpu")):  # step_pipeline's, around the schedule
                out = module(x)
                loss = loss_fn(out, ys[mb]) if stage == last else None
            if stage == last:
                outputs.append(out)
            cache[(stage, mb)] = (out, loss)
        else:
            out, loss = cache.pop((stage, mb))
            if loss is not None:
                loss.backward()
            else:
                out.backward(layout.grad_recv[stage][mb])
    if outputs:  # the schedule merges the last stage's outputs; step_pipeline's metrics read them
        merged = torch.cat(outputs)
        metrics(merged, targets, torch.zeros(()), samples=len(targets))


def _tensors(batch) -> list[torch.Tensor]:
    if torch.is_tensor(batch):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    return [t for t in values if torch.is_tensor(t)]


@contextlib.contextmanager
def quiet():
    """fully_shard's warnings about views: the plan builds, it does not edit outputs in place."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
