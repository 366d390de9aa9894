"""The probes of `python -m recipes check`: what in a model makes N ranks train apart from one process.

They run in the checking process, with no process group, on the first batches of the data as the recipe
collates them and with the loss the recipe takes (core.loss): parameters that get no gradient, BatchNorm,
randomness in the forward, non-deterministic ops. Each finding names the layers and a fix in the options the
recipe actually has.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import default_collate

from core.config import RecipeError
from core.data import build_data, first_samples
from core.loss import forward_loss, local_count, make_loss
from core.models import build_model


@dataclass
class Finding:
    cause: str  # short: "unused parameters"
    detail: str  # which layers, why it breaks equivalence, and the fix
    crashes: bool = False  # makes DDP fail outright (rather than train apart): a likely cause of a crashed run


def few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def _forward_backward(model: nn.Module, batch, *, seed: int, loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one training-mode step on a copy of `model` (the original is untouched), with the
    loss the recipe takes (core.loss: any model output, pair or dict batches, -100 targets)."""
    model = copy.deepcopy(model).train()
    torch.manual_seed(seed)
    count = local_count([batch], model=model, loss_fn=loss).clamp(min=1.0)  # one process: the mean over counted
    value, _ = forward_loss(model, batch, loss_fn=loss, normalizer=count)
    value.backward()
    return value.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _unused(model: nn.Module, steps: list) -> tuple[list[str], bool]:
    """Trainable parameters without a gradient in some step probed, and whether it is the same set in every one."""
    sets = [
        frozenset(n for n, p in model.named_parameters() if p.requires_grad and n not in grads) for _, grads in steps
    ]
    return [n for n, _ in model.named_parameters() if any(n in s for s in sets)], len(set(sets)) == 1


def _unused_advice(names: list[str], *, every_step: bool, takes: frozenset[str]) -> str:
    """The fix for parameters without a gradient, in the options this recipe has (never a DDP kwarg it can't set)."""
    if "find_unused_parameters" not in takes:
        return "remove them or freeze them (requires_grad_(False)) in the model factory if that is meant"
    if every_step and "static_graph" in takes:
        return (
            "they are unused in every step probed, so pass --static-graph (DDP learns the unused set once), "
            "or --find-unused-parameters (a graph walk every step); or remove or freeze them"
        )
    return (
        "which are used varies from step to step, so pass --find-unused-parameters (--static-graph needs the "
        "same set every step); or make forward() use every parameter"
    )


def _batchnorm_advice(takes: frozenset[str], *, cuda: bool) -> str:
    if "sync_batchnorm" in takes and cuda:
        return "pass --sync-batchnorm (SyncBatchNorm: statistics over the global batch), or use LayerNorm/GroupNorm"
    if "sync_batchnorm" in takes:
        return (
            "SyncBatchNorm (--sync-batchnorm) needs CUDA and this machine has none; use LayerNorm/GroupNorm, "
            "or check on GPUs with --sync-batchnorm"
        )
    return "use LayerNorm/GroupNorm, or on GPUs return nn.SyncBatchNorm.convert_sync_batchnorm(model) from the factory"


def probe(
    model: nn.Module,
    batch,
    *,
    seed: int = 0,
    loss: str = "auto",
    other=None,
    takes: Sequence[str] = (),
    cuda: bool | None = None,
) -> list[Finding]:
    """What in `model` makes N ranks differ from one process: each finding names the layers and the fix.

    `other`: a second batch (which parameters are used may depend on it); `takes`: the recipe's option names
    (Config fields), so the advice names only options that exist; `cuda`: GPUs present (default: detected)."""
    loss_fn, takes = make_loss(loss), frozenset(takes)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    findings = []
    first, again, reseeded = (_forward_backward(model, batch, seed=s, loss=loss_fn) for s in (seed, seed, seed + 1))
    varied = [again, reseeded] + ([_forward_backward(model, other, seed=seed, loss=loss_fn)] if other else [])
    unused, every = _unused(model, [first, *varied])
    if unused:
        ddp = "find_unused_parameters" in takes  # the recipes that wrap in DDP; the others tolerate a missing grad
        why = "so DDP waits for them and fails at the next step" if ddp else "so they never train"
        advice = _unused_advice(unused, every_step=every, takes=takes)
        findings.append(Finding("unused parameters", f"{few(unused)} get no gradient, {why}; {advice}", crashes=ddp))
    norms = [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]
    if norms:
        findings.append(
            Finding(
                "BatchNorm without SyncBatchNorm",
                (
                    f"{few(norms)} normalise{'s' * (len(norms) == 1)} by each rank's share of the batch, not the "
                    f"global batch; {_batchnorm_advice(takes, cuda=cuda)}"
                ),
            )
        )
    if not _same(first, again):
        findings.append(
            Finding(
                "non-deterministic layers",
                (
                    "two steps with the same seed and batch differ; find the op with "
                    "torch.use_deterministic_algorithms(True), or accept a tolerance"
                ),
            )
        )
    elif not _same(first, reseeded):
        dropout = [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
        where = f"dropout ({few(dropout)})" if dropout else "randomness in forward() (torch.rand*, F.dropout)"
        findings.append(
            Finding(
                "dropout or other randomness not seeded per rank",
                (
                    f"{where} draws from the RNG: every rank is seeded alike, so all ranks draw the same masks, and no "
                    f"seeding draws the masks one process would; seed each rank apart (seed + rank) and compare "
                    f"distributed with single-process with dropout off (p=0)"
                ),
            )
        )
    findings += _deterministic_check(model, batch, seed=seed, loss=loss_fn)
    return findings


def _deterministic_check(model: nn.Module, batch, *, seed: int, loss) -> list[Finding]:
    """Ops that torch itself knows to be non-deterministic refuse to run in deterministic mode."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _forward_backward(model, batch, seed=seed, loss=loss)
        return []
    except RuntimeError as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "deterministic" not in message or "CUBLAS_WORKSPACE_CONFIG" in message:
            return []  # another failure, or cuBLAS setup only: nothing about the model
        return [Finding("non-deterministic layers", f"{message}; results differ from run to run")]
    finally:
        torch.use_deterministic_algorithms(before)


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def sample_batches(data_spec: str, *, size: int, count: int = 1) -> list:
    """`count` batches of `size` training samples, collated as the recipe collates them (the factory's collate_fn
    or default_collate): map-style data or a stream, pairs or dicts. A problem is one RecipeError line."""
    train, _, collate = build_data(data_spec)  # a factory that raises or returns the wrong thing: RecipeError
    try:
        samples = first_samples(train, size * count)
    except Exception as err:  # the user's data set raised while being read
        raise RecipeError(f"--data {data_spec}: reading the training set raised {one_line(err)}") from None
    if not samples:
        raise RecipeError(f"--data {data_spec}: the training set is empty")
    try:
        chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
        chunks = chunks[:1] + [c for c in chunks[1:] if len(c) == size]  # a short extra batch probes nothing new
        return [(collate or default_collate)(chunk) for chunk in chunks[:count]]
    except Exception as err:
        raise RecipeError(
            f"--data {data_spec}: collating {size} training samples raised {one_line(err)}; "
            f"return a collate_fn as the third item of the factory's result"
        ) from None


def sample_batch(data_spec: str, *, size: int):
    """One collated batch of the first `size` training samples (see sample_batches)."""
    return sample_batches(data_spec, size=size)[0]


def probe_spec(*, model: str, data: str, loss: str, batch_size: int, seed: int, takes: frozenset) -> list[Finding]:
    """Build the model and two batches as the recipe does, and probe them; any failure is one RecipeError line."""
    torch.manual_seed(seed)
    make_loss(loss)  # a bad --loss: one RecipeError line, as a bad --model or --data below
    built = build_model(model)
    batches = sample_batches(data, size=batch_size, count=2)
    try:
        return probe(
            built, batches[0], other=batches[1] if len(batches) > 1 else None, seed=seed, loss=loss, takes=takes
        )
    except RecipeError as err:  # the loss contract refused this model's output or this batch
        raise RecipeError(f"--model {model} --data {data}: {err}") from None
    except Exception as err:  # the model can't train on this data at all: no point in launching anything
        raise RecipeError(
            f"--model {model} --data {data}: one training step fails ({one_line(err)}); fix the model or the data first"
        ) from None
