"""One training step on the first samples, as the recipes take it, for the pre-check and `check`: what
would fail in the ranks (tools/precheck.py), and what makes N ranks train apart from one process (tools/check.py).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from core.kernel.job import RecipeError
from core.kernel.loss import Loss, forward, make_loss
from core.plugins.loss import CHOICES  # importing it attaches --loss's choices to make_loss, as in the recipes


@dataclass
class Finding:
    cause: str  # short: "unused parameters"
    detail: str  # which layers, why it breaks equivalence, and the fix
    crashes: bool = False  # makes DDP fail outright (rather than train apart): a likely cause of a crashed run
    layers: tuple[str, ...] = ()  # the modules it is about, where `check` can switch them off (dropout)


RANDOMNESS = "dropout or other randomness"  # a Finding's cause: equal in distribution, not bit for bit


def few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def first_samples(dataset, n: int, *, spec: str) -> list:
    """The first `n` training samples of a map-style data set or a stream; one line when reading raises."""
    try:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):  # a stream: read in order
            return list(itertools.islice(dataset, n))
        return [dataset[i] for i in range(min(n, len(dataset)))]
    except Exception as err:  # the user's data set raised while being read
        raise RecipeError(f"--data {spec}: reading the training set raised {one_line(err)}") from None


def collated(samples: list, collate, *, spec: str):
    """The samples as one batch, by the factory's collate_fn or torch's default one; one line when it raises."""
    try:
        return (collate or default_collate)(samples)
    except Exception as err:  # e.g. sequences of different lengths and no collate_fn to pad them
        if collate is not None:  # the user's own collate_fn
            raise RecipeError(
                f"--data {spec}: the factory's collate_fn raised {one_line(err).rstrip('.')} on {len(samples)} "
                f"training samples; fix the collate_fn"
            ) from None
        raise RecipeError(
            f"--data {spec}: collating {len(samples)} training samples raised {one_line(err)}; "
            f"return a collate_fn as the third item of the factory's result"
        ) from None


def sample_batches(train, collate, *, spec: str, size: int, count: int = 1) -> list:
    """`count` batches of `size` training samples, collated as the recipe collates them; a problem is one line."""
    samples = first_samples(train, size * count, spec=spec)
    if not samples:
        raise RecipeError(f"--data {spec}: the training set is empty")
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    chunks = chunks[:1] + [c for c in chunks[1:] if len(c) == size]  # a short extra batch probes nothing new
    return [collated(chunk, collate, spec=spec) for chunk in chunks[:count]]


def loss_of(spec: str, model: nn.Module) -> Loss:
    """`--loss spec` for the plain `model`, as the recipes take it; a choice that cannot work is one line."""
    return make_loss(SimpleNamespace(loss=spec), model)


def check_call(model: nn.Module, batch, loss: Loss, *, where: str) -> None:
    """One line naming the call made and the forward's signature when the batch does not fit it."""
    made = []
    loss.call(lambda *args, **kwargs: made.append((args, kwargs)), batch)  # the call the recipes make
    (args, kwargs), signature = made[0], inspect.signature(model.forward)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        parts = list(batch.items()) if isinstance(batch, Mapping) else list(enumerate(batch))
        names = {id(part): f"sample[{key!r}]" for key, part in reversed(parts)}  # the first part that is it
        words = [names.get(id(a), "...") for a in args] + [f"{k}={names.get(id(v), '...')}" for k, v in kwargs.items()]
        if isinstance(batch, Mapping):
            what, fix = f"a dict sample ({', '.join(batch)})", "name forward's parameters as the dict's keys"
        else:
            what = f"a sample of {len(batch)} parts (inputs..., target)"
            fix = "give forward one parameter per input (every part but the last, the target), or change the samples"
        raise RecipeError(
            f"{where}: {what} is passed as model({', '.join(words)}), and {type(model).__name__}.forward{signature} "
            f"does not take it ({err}); {fix}"
        ) from None


def train_step(model: nn.Module, batch, loss: Loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and the gradients of one training-mode step (the kernel's forward); the model's own are left alone."""
    model.train()
    before = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    try:
        value, _ = forward(model, batch, loss)
        value.backward()
        return value.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    finally:
        for n, p in model.named_parameters():
            p.grad = before[n]


def losses_that_work(model: nn.Module, batch, *, besides: str) -> list[str]:
    """The built-in --loss choices (other than `besides`) with which one forward of this batch gives a loss."""
    working = []
    for spec in (s for s in CHOICES if s != besides):
        try:
            with torch.no_grad():
                forward(model, batch, loss_of(spec, model))
            working.append(spec)
        except Exception:  # this choice cannot work either
            continue
    return working


def unused_parameters(model: nn.Module, grads: dict[str, torch.Tensor]) -> list[str]:
    """Trainable parameters that got no gradient in a step."""
    return [n for n, p in model.named_parameters() if p.requires_grad and n not in grads]


def _forward_backward(model: nn.Module, batch, *, seed: int, loss: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """train_step on a copy of `model` (the original is untouched), seeded."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    return train_step(model, batch, loss_of(loss, model))


def _same(a, b) -> bool:
    """Two probe steps bit for bit, nan equal to nan (a step that is not finite is not thereby non-deterministic)."""
    return _equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(_equal(a[1][k], b[1][k]) for k in a[1])


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())


def _not_finite(step) -> list[str]:
    """'the loss' and the parameters whose gradient holds nan or inf, in one probe step."""
    loss, grads = step
    return ["the loss"] * (not bool(loss.isfinite().all())) + [n for n, g in grads.items() if not g.isfinite().all()]


def _unused(model: nn.Module, steps: list) -> tuple[list[str], bool]:
    """Trainable parameters without a gradient in some step probed, and whether it is the same set in every one."""
    sets = [frozenset(unused_parameters(model, grads)) for _, grads in steps]
    return [n for n, _ in model.named_parameters() if any(n in s for s in sets)], len(set(sets)) == 1


def unused_advice(*, every_step: bool, takes: frozenset[str]) -> str:
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


def batchnorm_layers(model: nn.Module) -> list[str]:
    """The BatchNorm layers that normalise by each rank's share of the batch (not SyncBatchNorm), with their class."""
    return [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]


def _batchnorm_advice(takes: frozenset[str], *, cuda: bool) -> str:
    if "sync_batchnorm" in takes and cuda:
        return "pass --sync-batchnorm (SyncBatchNorm: statistics over the global batch), or use LayerNorm/GroupNorm"
    if "sync_batchnorm" in takes:
        return (
            "SyncBatchNorm (--sync-batchnorm) needs CUDA and this machine has none; use LayerNorm/GroupNorm, "
            "or check on GPUs with --sync-batchnorm"
        )
    return "use LayerNorm/GroupNorm, or on GPUs return nn.SyncBatchNorm.convert_sync_batchnorm(model) from the factory"


def dropout_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]


def probe(
    model: nn.Module, batch, *, seed: int = 0, loss: str = "auto", other=None, takes: Sequence[str] = (), cuda=None
) -> list[Finding]:
    """What in `model` makes N ranks differ from one process, each finding with the layers and a fix in the options
    the recipe `takes`; `other`: a second batch (which parameters are used may depend on it)."""
    takes = frozenset(takes)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    findings = []
    first, again, reseeded = (_forward_backward(model, batch, seed=s, loss=loss) for s in (seed, seed, seed + 1))
    varied = [again, reseeded] + ([_forward_backward(model, other, seed=seed, loss=loss)] if other else [])
    if bad := _not_finite(first):
        weights = [n for n, p in model.named_parameters() if not p.isfinite().all()]
        cause = f"the weights {few(weights)} hold nan or inf" if weights else "the data or the loss makes them"
        fix = "fix the model factory or the data (lowering --lr does not help a first step)"
        detail = f"one step on the first samples gives nan or inf in {few(bad)} before any training: {cause}; {fix}"
        findings.append(Finding("not finite", detail, crashes=True))
    unused, every = _unused(model, [first, *varied])
    if unused:
        ddp = "find_unused_parameters" in takes  # the recipes that wrap in DDP; the others tolerate a missing grad
        why = "so DDP waits for them and fails at the next step" if ddp else "so they never train"
        advice = unused_advice(every_step=every, takes=takes)
        findings.append(Finding("unused parameters", f"{few(unused)} get no gradient, {why}; {advice}", crashes=ddp))
    if norms := batchnorm_layers(model):
        share = f"normalise{'s' * (len(norms) == 1)} by each rank's share of the batch, not the global batch"
        detail = f"{few(norms)} {share}; {_batchnorm_advice(takes, cuda=cuda)}"
        findings.append(Finding("BatchNorm without SyncBatchNorm", detail))
    if not _same(first, again):
        find = "find the op with torch.use_deterministic_algorithms(True), or accept a tolerance"
        findings.append(Finding("non-deterministic layers", f"two steps with the same seed and batch differ; {find}"))
    elif not _same(first, reseeded):
        dropout = dropout_layers(model)
        where = f"dropout ({few(dropout)})" if dropout else "randomness in forward() (torch.rand*, F.dropout)"
        how = "each rank draws its own (seeded seed + rank), as one process draws over the whole batch"
        alike = "so N ranks and one process train alike in distribution, not bit for bit"
        findings.append(Finding(RANDOMNESS, f"{where} draws from the RNG: {how}, {alike}", layers=tuple(dropout)))
    findings += _deterministic_check(model, batch, seed=seed, loss=loss)
    return findings


def _deterministic_check(model: nn.Module, batch, *, seed: int, loss: str) -> list[Finding]:
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
