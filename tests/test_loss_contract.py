"""The loss contract (the kernel's forward, the loss plug-in): model outputs, tuple and dict batches, -100, --loss;
the exact normalisation over ranks and micro-batches (core.exact_loss, core.amp); throughput from the steps' own
counts (the meter plug-in)."""

import dataclasses
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

import core.plugins.loss  # noqa: F401 - --loss, as the package runs
import core.plugins.loss_counts  # noqa: F401 - num_items_in_batch, as the package runs
from core.accum import step_amp
from core.amp import grad_sync
from core.exact_loss import count_targets, forward_exact, make_exact_loss
from core.kernel.job import RecipeError
from core.kernel.loss import forward, make_loss, split_outputs
from core.kernel.replica import evaluate
from core.kernel.seams import SEAMS
from core.kernel.step import step_plain
from core.kernel.train import Tally, summarize
from core.mesh import evaluate_sharded
from core.plugins import meter
from core.plugins.loss import split_any
from world import GlooWorld

CPU = torch.device("cpu")
V, T = 50, 8


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=V,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).eval()  # eval: no dropout, so runs compare exactly


def bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=V,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).eval()


class NanoGPT(nn.Module):
    """nanoGPT's shape: forward(idx, targets=None) -> (logits, loss); causal mixing by a running sum."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.head = nn.Embedding(V, 16), nn.Linear(16, V)

    def forward(self, idx, targets=None):
        logits = self.head(torch.tanh(self.emb(idx)).cumsum(1))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class Wrapped(nn.Module):
    """A classifier whose output is dressed as `kind`: tensor, tuple, list, dict."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.lin = kind, nn.Linear(4, 3)

    def forward(self, x):
        logits = self.lin(x)
        return {"tensor": logits, "tuple": (logits,), "list": [logits, logits.sum(-1)], "dict": {"logits": logits}}[
            self.kind
        ]


class NoLoss(nn.Module):
    """Takes targets, returns no loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, targets=None):
        return self.lin(x)


class LossOnly(nn.Module):
    """A model that returns only its loss (a dict batch, labels inside): no logits, so no accuracy."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels)}


class SelfSupervised(LossOnly):
    def forward(self, x, y):
        return super().forward(x, y)


def custom_loss(outputs, batch):  # a --loss module:function: the mean over the batch's counted targets
    return F.cross_entropy(split_outputs(outputs)[0], batch[1])


def lm_batch(lengths, *, seed: int, width: int = T, pairs: bool = False):
    """Padded token sequences: labels -100 past each length, attention 0 there (a collate function's output)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    if pairs:  # (input, target): the target already shifted, as core.gpt's data and nanoGPT's are
        return ids, torch.cat([labels[:, 1:], torch.full((len(lengths), 1), -100)], 1)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class ThreeParts(nn.Module):
    """forward(x, mask): samples are (input, mask, target), the last part the target."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, x, mask):
        return self.lin(x * mask)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


def loss_for(spec: str, model):
    """--loss spec as the recipes take it: the kernel's make_loss, then the loss plug-in's choice."""
    return make_loss(SimpleNamespace(loss=spec), model)


def base_loss(model):
    """The kernel's loss without the loss plug-in: what a lean copy takes."""
    with mock.patch.dict(SEAMS, loss_choices=[]):
        return make_loss(None, model)


@pytest.fixture
def one_rank():
    """A process group of one (evaluation and the clock reduce over the ranks)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def exact(model, batch, spec="auto", normalizer=1.0):
    return forward_exact(model, batch, make_exact_loss(loss_for(spec, model), model=model), normalizer=normalizer)


@pytest.mark.fast
def test_make_loss_specs():
    model = Wrapped("tensor")
    assert [loss_for(s, model).spec for s in ("auto", "ce", "mse")] == ["auto", "ce", "mse"]
    assert loss_for("test_loss_contract:custom_loss", model).fn.args == (custom_loss,)
    for bad in ("mean", "no_such_module_xyz:f", "test_loss_contract:nothing"):
        with pytest.raises(RecipeError, match="--loss") as err:
            loss_for(bad, model)
        assert "\n" not in str(err.value)


@pytest.mark.fast
def test_loss_model_on_a_forward_without_targets_is_refused_when_the_loss_is_made():
    """Before any process starts (the pre-check makes the loss): one line naming the forward and the fix."""
    with pytest.raises(RecipeError, match=r"--loss model: Wrapped.forward\(x\) takes no targets") as err:
        loss_for("model", Wrapped("tensor"))
    assert "--loss ce or mse" in str(err.value) and "auto" not in str(err.value)


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["tensor", "tuple", "list", "dict"])
def test_output_shapes_give_cross_entropy_and_accuracy(kind):
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, -100, 1])
    model = Wrapped(kind)
    loss, metrics = exact(model, (x, y), normalizer=5.0)
    logits = model.lin(x)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y, reduction="sum").double() / 5)
    mean, plain = forward(model, (x, y), loss_for("auto", model))
    torch.testing.assert_close(mean, F.cross_entropy(logits, y, ignore_index=-100))
    for m in (metrics, plain):
        assert m["count"].item() == 5 and m["samples"].item() == 6  # -100 counts nowhere
        assert m["correct"].item() == ((logits.argmax(-1) == y) & (y != -100)).sum().item()


@pytest.mark.fast
def test_split_outputs_orders():
    logits, loss = torch.randn(2, 3), torch.tensor(0.5)
    for outputs in (logits, (logits, loss), [logits, loss], {"logits": logits, "loss": loss}, (loss, logits)):
        got_logits, got_loss = split_any(outputs)  # the opt-in's: (loss, logits, ...) too, transformers' tuples
        assert got_logits is logits and (got_loss is None or got_loss is loss)
        if not isinstance(outputs, tuple) or outputs[0] is logits:  # the base's shapes
            assert split_outputs(outputs) == (got_logits, got_loss)
    assert split_outputs({"loss": loss}) == (None, loss)
    with pytest.raises(RecipeError, match="the model returned str"):
        split_outputs("logits")


@pytest.mark.fast
def test_nanogpt_auto_uses_its_own_loss_called_with_the_targets():
    """Issue 20 item 1: forward(idx, targets=None) takes the targets, so auto calls it with them and uses its loss
    (its logits without targets are the last position only: cross-entropy against all targets would fail)."""
    x, y = lm_batch([8, 5, 3], seed=1, pairs=True)
    model = NanoGPT()
    logits, own = model(x, targets=y)
    assert loss_for("auto", model).targets_as == "targets"
    for spec in ("auto", "model"):
        mean, metrics = forward(model, (x, y), loss_for(spec, model))
        torch.testing.assert_close(mean, own)
        assert metrics["count"].item() == 7 + 4 + 2 and "correct" in metrics
    mean, _ = forward(model, (x, y), loss_for("ce", model))  # ce: the logits of model(x), as before
    torch.testing.assert_close(mean, F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-100))
    with pytest.raises(RecipeError, match="--loss model: the model returned Tensor with no loss"):
        forward(NoLoss(), (torch.randn(2, 4), torch.tensor([0, 1])), loss_for("model", NoLoss()))


@pytest.mark.fast
def test_samples_of_three_parts_call_the_model_with_all_but_the_last():
    """Issue 20 item 2: (input, mask, target): model(input, mask), the target last."""
    x, mask, y = torch.randn(5, 4), torch.ones(5, 4), torch.tensor([0, 1, 2, 1, 0])
    model = ThreeParts()
    mean, metrics = forward(model, (x, mask, y), loss_for("auto", model))
    torch.testing.assert_close(mean, F.cross_entropy(model(x, mask), y))
    assert metrics["samples"].item() == 5 and metrics["count"].item() == 5


@pytest.mark.fast
def test_float_targets_of_the_outputs_shape_get_mse_and_others_one_line():
    """Issue 20 item 1: regression with --loss auto is mse; float targets of another shape are one line."""
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    model = Regressor()
    for spec in ("auto", "mse"):
        mean, metrics = forward(model, (x, y), loss_for(spec, model))
        torch.testing.assert_close(mean, F.mse_loss(model(x), y))
        assert metrics["count"].item() == 6 and "correct" not in metrics
    with pytest.raises(RecipeError, match=r"float targets \(6,\) and outputs \(6, 2\) differ in shape"):
        forward(model, (x, y[:, 0]), loss_for("auto", model))
    with pytest.raises(RecipeError, match=r"--loss mse: int64 targets \(6,\) and outputs \(6, 2\) differ in shape"):
        forward(model, (x, torch.zeros(6, dtype=torch.int64)), loss_for("mse", model))  # a review find: "float"


@pytest.mark.fast
def test_custom_loss_is_weighted_by_count():
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 1])
    model = Wrapped("tensor")
    loss, _ = exact(model, (x, y), "test_loss_contract:custom_loss", normalizer=2.0)
    torch.testing.assert_close(loss.double(), F.cross_entropy(model(x), y).double() * 4 / 2)


@pytest.mark.fast
def test_no_logits_no_accuracy(one_rank):
    batch = {"x": torch.randn(5, 4), "labels": torch.randn(5)}
    _, metrics = exact(LossOnly(), batch)
    assert "correct" not in metrics and metrics["count"].item() == 5  # float labels: one per sample
    result = evaluate(LossOnly(), [batch], loss_fn=loss_for("auto", LossOnly()), device=CPU)
    assert set(result) == {"val_loss"}
    unlabelled = {"x": batch["x"], "y": batch["labels"]}  # no `labels`: the model's own loss, one per sample
    model = SelfSupervised()
    loss, metrics = exact(model, unlabelled)
    assert metrics["count"].item() == 5 and loss.item() == pytest.approx(5 * model(**unlabelled)["loss"].item())


@pytest.mark.fast
def test_transformers_causal_lm_dict_batch():
    model, batch = gpt2(), lm_batch([8, 3, 6], seed=2)
    loss_fn = make_exact_loss(loss_for("auto", model), model=model)
    assert (loss_fn.counted is not None, loss_fn.loss.shifts) == (
        True,
        True,
    )  # takes num_items_in_batch; shifts its labels
    loss, metrics = forward_exact(model, batch, loss_fn, normalizer=4.0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shifted = batch["labels"][:, 1:]
    total = F.cross_entropy(logits[:, :-1].flatten(0, 1), shifted.flatten(), reduction="sum")
    torch.testing.assert_close(loss.double(), total.double() / 4)
    assert metrics["count"].item() == 7 + 2 + 5 and metrics["samples"].item() == 3
    correct = ((logits[:, :-1].argmax(-1) == shifted) & (shifted != -100)).sum()
    assert metrics["correct"].item() == correct.item()
    mean, plain = forward(model, batch, loss_for("auto", model))  # the base (ddp) knows the shift too (review4)
    assert plain["count"].item() == 14 and plain["correct"].item() == correct.item()
    torch.testing.assert_close(plain["loss_sum"], total.double(), rtol=1e-6, atol=1e-6)  # the mean x shifted count
    lean = dataclasses.replace(loss_fn, counted=None)  # a copy without loss_counts: the mean, weighed alike
    loss3, metrics3 = forward_exact(model, batch, lean, normalizer=4.0)
    torch.testing.assert_close(loss3.double(), total.double() / 4)
    assert metrics3["count"].item() == 14 and metrics3["correct"].item() == correct.item()
    model.accepts_loss_kwargs = False  # the other path: the model's mean, weighted by its (shifted) count
    loss2, _ = forward_exact(model, batch, make_exact_loss(loss_for("auto", model), model=model), normalizer=4.0)
    torch.testing.assert_close(loss2.double(), total.double() / 4)


@pytest.mark.fast
def test_transformers_sequence_classifier():
    model = bert()
    loss_fn = make_exact_loss(loss_for("auto", model), model=model)
    assert (loss_fn.counted is not None, loss_fn.loss.shifts) == (
        False,
        False,
    )  # **kwargs, but its loss ignores num_items
    ids = torch.randint(V, (4, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 2, -100, 1])}
    loss, metrics = forward_exact(model, batch, loss_fn, normalizer=3.0)
    logits = model(input_ids=ids).logits
    torch.testing.assert_close(loss.double(), F.cross_entropy(logits, batch["labels"], reduction="sum").double() / 3)
    assert metrics["count"].item() == 3 and "correct" in metrics


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _simulate(model, ranks, loss_fn):
    """W ranks, each with K micro-batches, on one process: each rank's gradient with the normaliser
    the global batch's counted targets / W, then averaged as DDP would."""
    world = len(ranks)
    normalizer = sum(count_targets(b, loss_fn) for mb in ranks for b in mb).clamp(min=1) / world
    per_rank = []
    for micro_batches in ranks:
        model.zero_grad(set_to_none=True)
        for batch in micro_batches:
            forward_exact(model, batch, loss_fn, normalizer=normalizer)[0].backward()
        per_rank.append(_grads(model))
    return [torch.stack(g).mean(0) for g in zip(*per_rank)]


def _concat(batches):
    if isinstance(batches[0], dict):
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    return tuple(torch.cat(parts) for parts in zip(*batches))


def gpt2_no_num_items() -> GPT2LMHeadModel:
    model = gpt2()
    model.accepts_loss_kwargs = False  # transformers' own switch: its mean loss is then weighted by its count
    return model


MODELS = {  # name -> (build, loss spec, pair batches)
    "gpt2 num_items_in_batch": (gpt2, "auto", False),
    "gpt2 weighted mean": (gpt2_no_num_items, "auto", False),
    "nanogpt --loss model": (NanoGPT, "model", True),
    "nanogpt auto (its own)": (NanoGPT, "auto", True),
    "nanogpt ce": (NanoGPT, "ce", True),
}


@pytest.mark.fast
@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), world=st.integers(1, 3), k=st.integers(1, 3))
def test_ranks_times_micro_batches_equal_one_process(name, data, world, k):
    build, spec, pairs = MODELS[name]
    model = build()
    loss_fn = make_exact_loss(loss_for(spec, model), model=model)
    sizes = st.lists(st.integers(0, T), min_size=1, max_size=3)  # 0: a sequence with nothing counted
    ranks = [
        [lm_batch(data.draw(sizes), seed=data.draw(st.integers(0, 99)), pairs=pairs) for _ in range(k)]
        for _ in range(world)
    ]
    got = _simulate(model, ranks, loss_fn)
    model.zero_grad(set_to_none=True)
    whole = _concat([b for micro_batches in ranks for b in micro_batches])
    normalizer = count_targets(whole, loss_fn).clamp(min=1)
    forward_exact(model, whole, loss_fn, normalizer=normalizer)[0].backward()
    for g, want in zip(got, _grads(model)):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


@pytest.mark.fast
def test_mean_of_means_is_not_the_global_mean():
    """What the old normalisation (each micro-batch's mean, weighted by its share of samples) gets wrong."""
    model = NanoGPT()
    loss_fn = make_exact_loss(loss_for("ce", model), model=model)
    micro = [lm_batch([8, 8], seed=3, pairs=True), lm_batch([2, 1], seed=4, pairs=True)]
    model.zero_grad()
    for batch in micro:
        (forward(model, batch, loss_fn.loss)[0] / 2).backward()
    old = _grads(model)
    exact_grads = _simulate(model, [micro], loss_fn)
    assert not torch.allclose(old[0], exact_grads[0])


@pytest.mark.fast
def test_step_plain_and_step_amp_on_dict_batches(one_rank):
    model, batch = gpt2(), lm_batch([8, 2, 5], seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics, norm = step_plain(model, batch, optimizer=opt, loss_fn=loss_for("auto", model))
    assert metrics["count"].item() == 7 + 1 + 4 and math.isfinite(norm)  # the base counts them after the shift too
    loss_fn = make_exact_loss(loss_for("auto", model), model=model)
    metrics, stats = step_amp(model, [batch, batch], optimizer=opt, loss_fn=loss_fn, precision="bf16")
    assert metrics["samples"].item() == 6 and math.isfinite(stats.grad_norm) and not stats.skipped
    assert metrics["count"].item() == 2 * (7 + 1 + 4)  # shifted: one target fewer a sequence
    evaluation = evaluate_sharded(model, [batch], loss_fn=loss_fn, device=CPU)  # the exact weights' evaluation
    assert evaluation.keys() == {"val_loss", "val_acc"}


def _sums(**values):
    return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in values.items()}


@pytest.mark.fast
def test_meter_samples_tokens_and_nonfinite(one_rank):
    """The clock starts when the first step ends: the rates count the steps after it (issue 20 item 10)."""
    meter.clock_reset(None, None)
    meter.clock_step(_sums(loss_sum=30, count=60, samples=4))  # the first step: start-up, not in the rates
    assert "samples_per_s" not in meter.clock_rates()  # --log-every 1: no rate yet (review4: it said 0 samples/s)
    window = Tally(CPU)
    window.add(_sums(loss_sum=30, count=60, samples=4))
    meter.clock_step(_sums(loss_sum=30, count=60, samples=4))
    record = summarize(window.reduce()) | meter.clock_rates()
    assert record["tokens_per_s"] / record["samples_per_s"] == pytest.approx(15.0)
    assert record["loss"] == 0.5 and "acc" not in record
    assert meter.throughput(None, None, None)["startup_s"] >= 0 and meter.TRAINED["samples"] == 4  # one step of 4
    window = Tally(CPU)
    window.add(_sums(loss_sum=float("nan"), count=4, samples=4, correct=3, scored=4))  # metrics() gives both
    meter.clock_step(_sums(loss_sum=float("nan"), count=4, samples=4, correct=3))
    record = summarize(window.reduce()) | meter.clock_rates()
    assert math.isnan(record["loss"]) and record["acc"] == 0.75 and "tokens_per_s" not in record  # null in the record


@pytest.mark.fast
def test_flops_per_sample_takes_dict_and_pair_samples():
    from core.monitor import flops_per_sample  # ddp_monitored's MFU

    sample = {k: v[0] for k, v in lm_batch([8], seed=0).items()}
    assert flops_per_sample(gpt2, sample) > 0
    x, y = lm_batch([8], seed=0, pairs=True)
    per_sequence = flops_per_sample(NanoGPT, (x[0], y[0]))
    assert per_sequence == flops_per_sample(NanoGPT, x[0]) > 0


# Real DDP in a gloo world of 2.


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2) as world:
        yield world


def _ddp_gpt2_step(topo, ranks):
    model = DistributedDataParallel(gpt2())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = make_exact_loss(loss_for("auto", model.module), model=model.module)
    metrics, _ = step_amp(model, ranks[topo.rank], optimizer=opt, loss_fn=loss_fn, sync=grad_sync)
    return [p.detach().clone() for p in model.module.parameters()], {k: v.item() for k, v in metrics.items()}


@pytest.mark.world
def test_step_amp_under_ddp_matches_one_process(world2):
    ranks = [
        [lm_batch([8, 1], seed=10), lm_batch([3, 0, 6], seed=11)],
        [lm_batch([2], seed=12), lm_batch([8, 8, 7], seed=13)],
    ]
    results = world2.run(_ddp_gpt2_step, ranks)
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step_amp(
        model,
        [_concat([b for r in ranks for b in r])],
        optimizer=opt,
        loss_fn=make_exact_loss(loss_for("auto", model), model=model),
    )
    for rank_params, _ in results:
        for got, want in zip(rank_params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert results[0][1]["count"] == 7 + 0 + 2 + 0 + 5 and results[1][1]["count"] == 1 + 7 + 7 + 6


# --- what a sample means (issue 27.1): a pair's target is aligned with the output, whatever the model shifts -----


class NanoGPTInference(NanoGPT):
    """nanoGPT exactly: without targets it returns the last position's logits only (its generation path)."""

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return (logits, loss) if targets is not None else (logits[:, [-1], :], None)


@pytest.mark.fast
def test_a_pair_target_is_compared_position_by_position_with_a_transformers_lm():
    """Issue 27.1: `--loss auto` on (input, target) pairs gave the target to GPT-2 as `labels`, which transformers
    shifts once more (the token two ahead). Now: cross-entropy of logits[:, t] against target[:, t], written here
    by hand, in the plain forward and the exact one; the accuracy compares the same positions."""
    model = gpt2()
    x, y = lm_batch([8, 5, 3], seed=6, pairs=True)
    logits = model(x).logits
    by_hand = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    assert loss_for("auto", model).targets_as is None  # never `labels`
    mean, plain = forward(model, (x, y), loss_for("auto", model))
    torch.testing.assert_close(mean, by_hand)
    total, sums = exact(model, (x, y), normalizer=2.0)
    torch.testing.assert_close(total.double(), by_hand.double() * (7 + 4 + 2) / 2)
    correct = ((logits.argmax(-1) == y) & (y != -100)).sum().item()
    assert plain["correct"].item() == sums["correct"].item() == correct and sums["count"].item() == 7 + 4 + 2


@pytest.mark.fast
def test_loss_model_on_pairs_for_a_forward_that_takes_only_labels_is_one_line_naming_the_fix():
    model = gpt2()
    loss = loss_for("model", model)
    with pytest.raises(RecipeError, match=r"--loss model: GPT2LMHeadModel takes its targets as `labels`") as err:
        forward(model, lm_batch([4, 4], seed=1, pairs=True), loss)
    assert "dict samples with `labels`" in str(err.value) and "--loss ce" in str(err.value)
    assert "\n" not in str(err.value)
    from tools.precheck import check_step  # before launch: the same line, the fix kept

    with pytest.raises(RecipeError, match=r"--loss model: GPT2LMHeadModel takes .*dict samples with `labels`") as err:
        check_step(model, lm_batch([4, 4], seed=1, pairs=True), model_spec="m:gpt2", data_spec="m:pairs", loss="model")
    assert "\n" not in str(err.value)
    mean, _ = forward(model, lm_batch([4, 4], seed=1), loss)  # a dict with labels: the model's own, shifted
    batch = lm_batch([4, 4], seed=1)
    torch.testing.assert_close(mean, model(**batch).loss)


@pytest.mark.fast
def test_logits_of_the_last_position_only_are_one_line_naming_cause_and_fix():
    """Issue 27.4: nanoGPT's inference path (no targets given: --loss ce) against T targets, in the loss plug-in and in
    the pipeline's TokenLoss, where the shapes are compared; the pre-check quotes the same line."""
    import core.plugins.loss  # noqa: F401 - its line, which TokenLoss asks for (the SEAMS["loss_checks"] seam)
    from core.schedules import TokenLoss
    from tools.precheck import check_step

    model, batch = NanoGPTInference(), lm_batch([8, 8], seed=2, pairs=True)
    for call in (
        lambda: forward(model, batch, loss_for("ce", model)),
        lambda: TokenLoss()(model(batch[0])[0], batch[1]),
    ):
        with pytest.raises(RecipeError, match=r"the model returns logits for one position \(2, 1, 50\)") as err:
            call()
        assert f"targets of {T} positions" in str(err.value) and "return every position's logits" in str(err.value)
    with pytest.raises(RecipeError, match="logits for one position .*give the forward the targets") as err:
        check_step(model, batch, model_spec="m:nano", data_spec="m:pairs", loss="ce")
    assert "\n" not in str(err.value)
    forward(model, batch, loss_for("auto", model))  # auto passes the targets: every position's logits


# --- the base alone (issue 28.4): what a lean copy carries, the kernel's loss without the loss plug-in -------------


@pytest.mark.fast
def test_the_base_alone_takes_every_sample_shape_and_the_common_outputs():
    """make_loss() and forward, no plug-in: pairs (aligned cross-entropy, never `labels`), (x, mask, y), dicts with
    labels (the model's own loss), -100 ignored; logits, (logits,), (logits, loss), dict outputs. Float targets
    under --loss ce: one line (the plug-in's; a `targets` forward is the plug-in's, test_nanogpt_auto_...)."""
    model, (x, y) = gpt2(), lm_batch([8, 5, 3], seed=7, pairs=True)
    mean, _ = forward(model, (x, y), base_loss(model))
    torch.testing.assert_close(mean, F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100))
    batch = lm_batch([8, 5, 3], seed=7)
    torch.testing.assert_close(forward(model, batch, base_loss(model))[0], model(**batch).loss)
    three, (a, mask, c) = ThreeParts(), (torch.randn(5, 4), torch.ones(5, 4), torch.tensor([0, 1, 2, -100, 0]))
    torch.testing.assert_close(forward(three, (a, mask, c), base_loss(three))[0], F.cross_entropy(three(a, mask), c))
    for kind in ("tensor", "tuple", "list", "dict"):
        wrapped = Wrapped(kind)
        mean, sums = forward(wrapped, (a, c), base_loss(wrapped))
        torch.testing.assert_close(mean, F.cross_entropy(wrapped.lin(a), c))
        assert sums["count"].item() == 4 and "correct" in sums
    with pytest.raises(RecipeError, match="cross-entropy needs logits and int64 targets; use --loss model or mse"):
        forward(Regressor(), (a, torch.randn(5, 2)), loss_for("ce", Regressor()))


@pytest.mark.fast
def test_cross_entropy_on_a_dicts_sequence_labels_is_one_line():
    """A dict's `labels` follow transformers' convention: only the model knows whether it shifts them (a causal LM
    does, a token classifier does not). --loss ce on a GPT-2 would compare logits[t] with labels[t], the identity
    when labels = input_ids: refused in one line naming auto and pairs. A classifier's (B, classes) logits are not
    sequences: ce stays."""
    model, batch = gpt2(), lm_batch([8, 4], seed=3)
    with pytest.raises(RecipeError, match=r"--loss ce on a dict's `labels`, which a causal LM shifts") as e:
        forward(model, batch, loss_for("ce", model))
    assert "--loss auto" in str(e.value) and "(input, target) samples" in str(e.value) and "\n" not in str(e.value)

    class LogitsOnly(nn.Module):  # under auto: a model that returns no loss; the fix is not auto, which it has
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, input_ids, attention_mask=None, labels=None):
            return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits

    with pytest.raises(RecipeError, match=r"--loss auto on a dict's `labels`, which a causal LM shifts: return the"):
        forward(LogitsOnly(), batch, loss_for("auto", LogitsOnly()))
    classifier = bert()
    ids = torch.randint(V, (4, T))
    labelled = {"input_ids": ids, "labels": torch.tensor([0, 2, 1, 1])}
    mean, _ = forward(classifier, labelled, loss_for("ce", classifier))
    torch.testing.assert_close(mean, F.cross_entropy(classifier(input_ids=ids).logits, labelled["labels"]))


@pytest.mark.fast
def test_a_lean_copy_without_check_aligned_still_refuses_logits_that_do_not_line_up(monkeypatch):
    """A copy without `--with loss` has no check_aligned (core/plugins/loss.py): torch's own shape error then, never a
    loss over the wrong positions."""
    import core.plugins.loss

    monkeypatch.setattr(core.plugins.loss, "check_aligned", lambda logits, targets: None)
    model, batch = NanoGPTInference(), lm_batch([8, 8], seed=2, pairs=True)
    with pytest.raises(ValueError, match="Expected input batch_size"):
        forward(model, batch, loss_for("ce", model))


@pytest.mark.fast
def test_a_causal_lms_val_loss_weighs_each_counted_target_alike_in_the_base(one_rank):
    """review4: ddp's evaluate weighed a causal LM's mean loss by its labels before the shift (one token too many a
    row): val_loss over padded sequences of other lengths, by hand, is the mean over every shifted counted label."""
    model = gpt2(seed=3).eval()
    batches = [lm_batch([8, 2], seed=4), lm_batch([3, 7, 5], seed=5)]
    result = evaluate(model, batches, loss_fn=base_loss(model), device=CPU)
    losses, hits = [], []
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        shifted = batch["labels"][:, 1:]
        kept = shifted != -100
        losses.append(F.cross_entropy(logits[kept], shifted[kept], reduction="none"))
        hits.append(logits[kept].argmax(-1) == shifted[kept])
    assert result["val_loss"] == pytest.approx(torch.cat(losses).mean().item(), rel=1e-6)
    assert result["val_acc"] == pytest.approx(torch.cat(hits).double().mean().item(), rel=1e-9)


@pytest.mark.fast
def test_a_batch_with_no_counted_target_counts_nowhere(one_rank):
    """review4: a batch whose targets are all -100 (a prompt that fills the window) has a mean loss of 0/0 = nan; its
    sums are 0, so the val_loss of the others is not nan, in the base and in the exact weights alike."""
    model = nn.Linear(4, 3)
    masked = (torch.randn(2, 4), torch.full((2,), -100))
    counted = (torch.randn(3, 4), torch.tensor([0, 2, 1]))
    mean, metrics = forward(model, masked, base_loss(model))
    assert math.isnan(mean.item()) and metrics["loss_sum"].item() == 0 and metrics["count"].item() == 0
    hand = F.cross_entropy(model(counted[0]), counted[1]).item()
    assert evaluate(model, [masked, counted], loss_fn=base_loss(model), device=CPU)["val_loss"] == pytest.approx(
        hand, rel=1e-6
    )
    exact_fn = make_exact_loss(base_loss(model), model=model)
    assert evaluate_sharded(model, [masked, counted], loss_fn=exact_fn, device=CPU)["val_loss"] == (
        pytest.approx(hand, rel=1e-6)
    )
