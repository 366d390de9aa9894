"""Layer 1: pure functions, no process group."""

import dataclasses
import importlib
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from core.accum import Accumulation
from core.amp import Precision
from core.kernel.builtin import MLP, digits
from core.kernel.job import RecipeError, Training
from core.kernel.step import total_steps
from core.kernel.store import run_dirs
from core.kernel.train import ResumableSampler, Topology, make_loader
from core.plugins.factories import MODELS, resolve_factory
from core.zoo import quick_digits
from helpers import REPO, build_data, build_model, user_env
from tools.options import UsageError, parse_args
from tools.precheck import finished_run

pytestmark = pytest.mark.fast


@dataclasses.dataclass(frozen=True)
class TrainConfig(Training, Precision, Accumulation):
    """The groups most recipes combine."""


@settings(max_examples=200, deadline=None)
@given(
    world_size=st.integers(1, 8),
    length=st.integers(0, 200),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
    drop_last=st.booleans(),
)
def test_sampler_partitions_the_data_set(world_size, length, seed, epoch, drop_last):
    data = TensorDataset(torch.arange(length))
    per_rank = []
    for rank in range(world_size):
        sampler = ResumableSampler(data, num_replicas=world_size, rank=rank, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    counts = {len(indices) for indices in per_rank}
    assert len(counts) == 1, "every rank gets the same number of samples (else DDP's collectives desync)"
    everything = [i for indices in per_rank for i in indices]
    if drop_last:
        assert len(set(everything)) == len(everything), "disjoint"
        assert length - len(everything) < world_size, "only the tail that doesn't divide is dropped"
    else:
        assert set(everything) == set(range(length)), "the union is the whole set"
        # Padding repeats just enough samples to make the shares equal, never more.
        assert len(everything) - length == (-length) % world_size


def _topo(rank: int, world_size: int) -> Topology:
    return Topology(rank, world_size, torch.device("cpu"))


@settings(max_examples=50, deadline=None)
@given(world_size=st.integers(1, 8), length=st.integers(0, 100), batch_size=st.integers(1, 9))
def test_eval_shards_cover_every_sample_once(world_size, length, batch_size):
    data = TensorDataset(torch.arange(length))
    loaders = [
        make_loader(data, _topo(r, world_size), batch_size=batch_size, collate_fn=None, train=False)
        for r in range(world_size)
    ]
    assert sorted(i for loader in loaders for (batch,) in loader for i in batch.tolist()) == list(range(length))


@settings(max_examples=50, deadline=None)
@given(world_size=st.integers(1, 8), length=st.integers(0, 99), batch_size=st.integers(1, 40), epochs=st.integers(0, 3))
def test_total_steps_counts_the_batches_of_a_share_or_refuses_one_below_a_batch(world_size, length, batch_size, epochs):
    """The kernel's count (ddp, dp, ddp_monitored, pipeline_naive and their copies, which have no pre-check): every
    rank takes the same batches of its share; a share below one batch is the one line that says so."""
    loader = make_loader(TensorDataset(torch.arange(length)), _topo(0, world_size), batch_size=batch_size,
                         collate_fn=None)  # fmt: skip
    share = length // world_size  # drop_last: the tail that does not divide is trained by no rank
    if share < batch_size:
        with pytest.raises(RecipeError) as refused:
            total_steps(loader, epochs=epochs, max_steps=0)
        assert str(refused.value) == (
            f"--batch-size {batch_size}: a rank has {share} samples, not a batch; lower it or use fewer ranks"
        )
    else:  # the last batch of a share may be short (the ranks' shares are equal: each takes the same steps)
        assert total_steps(loader, epochs=epochs, max_steps=0) == epochs * -(-share // batch_size)
        assert total_steps(loader, epochs=epochs, max_steps=1) == min(1, epochs)


def test_sampler_order_depends_on_epoch_and_seed_only():
    data = TensorDataset(torch.arange(50))
    a, b = (ResumableSampler(data, num_replicas=2, rank=0, seed=1) for _ in range(2))
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(a) != list(b), "set_epoch reshuffles"


def test_resumable_sampler_skips_the_consumed_part_of_an_epoch():
    data = TensorDataset(torch.arange(40))
    full, resumed = (ResumableSampler(data, num_replicas=2, rank=1, seed=0) for _ in range(2))
    full.set_epoch(2)
    resumed.set_epoch(2, consumed=12)  # 6 samples of each of the 2 ranks
    assert list(resumed) == list(full)[6:] and len(resumed) == len(full) - 6


def test_digits_is_embedded_and_split():
    train, val = digits()
    assert len(train) + len(val) == 1797 and len(val) == 359
    quick = quick_digits()  # the package's --data digits: the same tensors, read without importing scikit-learn
    assert all(torch.equal(a, b) for mine, its in zip(quick, (train, val)) for a, b in zip(mine.tensors, its.tensors))
    x, y = train[0]
    assert x.shape == (64,) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1 and y.dtype == torch.int64


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_builtin_models_take_builtin_data(name):
    model = build_model(name)
    for data_name in ("digits", "synthetic"):
        x, _ = build_data(data_name)[0][:4]
        assert model(x).shape == (4, 10)


def test_no_helper_unwraps_by_attribute_name():
    """The old unwrap stripped any child named `module`: a user model holding one was saved as that child alone.
    Recipes now pass the plain model they built; nothing in core looks for a `.module` attribute to strip."""
    import pathlib

    for path in pathlib.Path(importlib.import_module("core").__file__).parent.glob("*.py"):
        assert 'getattr(model, "module"' not in path.read_text(), path


@pytest.mark.parametrize(
    "option,value,words",
    [
        ("batch_size", 0, "--batch-size 0"),
        ("epochs", -1, "--epochs -1"),
        ("lr", 0.0, "--lr 0.0"),
        ("accum", 0, "--accum 0"),
        ("precision", "fp8", "--precision fp8"),
        ("log_every", 0, "--log-every 0"),
    ],
)
def test_config_names_the_bad_option(option, value, words):
    with pytest.raises(RecipeError, match=words):
        TrainConfig(**{option: value})


def test_fp16_on_cpu_points_to_bf16():
    if torch.cuda.is_available():
        pytest.skip("fp16 is valid where CUDA is present")
    with pytest.raises(RecipeError, match="bf16"):
        TrainConfig(precision="fp16")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().lr = 1.0


def test_factories_resolve_builtins_and_module_functions():
    from core.zoo import cnn

    assert resolve_factory("mlp", MODELS, option="--model") is MLP  # the kernel's, called with no arguments
    assert resolve_factory("core.zoo:cnn", MODELS, option="--model") is cnn
    for spec, words in [
        ("nosuchpkg.mod:build", "cannot import 'nosuchpkg.mod'"),
        ("core.zoo:nothing", "has no function 'nothing'"),
        ("resnet", "not a built-in"),
    ]:
        with pytest.raises(RecipeError, match=words):
            resolve_factory(spec, MODELS, option="--model")


def test_ctrl_c_during_a_factorys_import_is_an_interrupt_not_a_missing_module(tmp_path, monkeypatch):
    """A review find: transformers' lazy import re-raises Ctrl-C as ModuleNotFoundError, which was reported as
    "cannot import ... is it installed or on PYTHONPATH?" with status 1."""
    (tmp_path / "lazy_user.py").write_text(
        "class Stopped(KeyboardInterrupt):\n    pass\n"  # as tools.cli's SIGTERM: the same interrupt comes out
        "try:\n    raise Stopped(15)\nexcept KeyboardInterrupt as err:\n"
        "    raise ModuleNotFoundError(\"Could not import module 'LlamaForCausalLM'\") from err\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt) as stopped:
        resolve_factory("lazy_user:build", MODELS, option="--model")
    assert type(stopped.value).__name__ == "Stopped" and stopped.value.args == (15,)


def test_sigterm_and_sighup_stop_the_runner_in_one_line_but_an_ignored_one_stays_ignored(monkeypatch):
    """A review find: `nohup python -m recipes run` (SIGHUP ignored) was stopped by SIGHUP."""
    import signal

    from tools.cli import Stopped, _stop_on_signals

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        with pytest.raises(Stopped):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_data_factory_must_return_a_pair(tmp_path, monkeypatch):
    (tmp_path / "bad_data.py").write_text("def build():\n    return [1, 2, 3]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tools.precheck import check_data  # the factory's contract is checked before launch, once

    with pytest.raises(RecipeError, match="bad_data:build"):
        check_data("bad_data:build", streams=False, recipe="ddp")


def test_run_dirs_count_up_and_never_reuse(tmp_path):
    first, second = run_dirs(tmp_path, "ddp", new=True)[-1], run_dirs(tmp_path, "ddp", new=True)
    assert (first.name, [p.name for p in second]) == ("ddp-1", ["ddp-1", "ddp-2"])  # the new one last
    (tmp_path / "ddp-10").mkdir()
    assert run_dirs(tmp_path, "ddp")[-1].name == "ddp-10" and run_dirs(tmp_path, "ddp", new=True)[-1].name == "ddp-11"
    assert run_dirs(tmp_path, "fsdp") == [] and run_dirs(tmp_path / "missing", "ddp") == []


@pytest.mark.fast
def test_a_run_is_finished_when_its_last_record_is_the_summary(tmp_path):
    """The pre-check's finished_run (the kernel's `finished` without a process group): the summary is written last,
    so a run whose last whole line is not it (stopped before, or torn while writing it) is not finished, whether
    --resume is auto or one of its checkpoints."""
    run, cfg = run_dirs(tmp_path, "ddp", new=True)[-1], SimpleNamespace(out=tmp_path, name="")
    summary = {"kind": "summary", "steps": 7}
    lines = ['{"kind": "train", "step": 5}', json.dumps(summary)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    step = str(run / "ckpt" / "step-000005.safetensors")
    assert finished_run(cfg, "ddp", "auto") and finished_run(cfg, "ddp", step)
    assert not finished_run(cfg, "ddp", "") and not finished_run(cfg, "fsdp", "auto")
    (run / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:-3])  # killed while writing the summary
    assert not finished_run(cfg, "ddp", "auto")
    (run / "metrics.jsonl").write_text(lines[0] + "\n")
    assert not finished_run(cfg, "ddp", step)
    assert not finished_run(cfg, "ddp", str(tmp_path / "elsewhere.safetensors"))


def test_an_unknown_option_is_a_usage_error_that_names_it():
    """The runner (tools/cli.py) turns it into the recipes that take it, or the nearest option (test_cli)."""
    with pytest.raises(UsageError, match="--epoch") as raised:
        parse_args(Training, ["--epoch", "2"])
    assert str(raised.value) == "unrecognized arguments: --epoch 2"


@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp", "tensor_parallel", "pipeline"])
def test_the_sharded_recipes_offer_no_fp16_they_would_refuse(name):
    """No loss scale agrees across gradient shards or stages there: --help lists fp32 and bf16 only."""
    config = importlib.import_module(f"recipes.{name}").Config
    assert config.__dataclass_fields__["precision"].metadata["choices"] == ("fp32", "bf16")
    with pytest.raises(UsageError, match="invalid choice: 'fp16'"):
        parse_args(config, ["--precision", "fp16"])


STARTUP = """
import time
time.sleep(0.5)  # before anything of the project: start-up counts from the process's start, not from the clock
import torch
from core.plugins import meter
meter.clock_reset(None, None)  # the run starts (the kernel's open_run)
one = torch.ones((), dtype=torch.float64)
meter.clock_step({"loss_sum": one, "count": one, "samples": one})  # the first optimizer step ends
print(meter.throughput(None, None, None)["startup_s"])
"""


def test_startup_counts_from_the_process_start_to_the_end_of_the_first_step():
    """27.6: every recipe starts the meter plug-in's clock somewhere in train(); startup_s is the same measure in all
    of them: from the process's start (imports included) to the end of the first optimizer step. A clock started
    after half a second of the process counts that half second."""
    proc = subprocess.run(
        [sys.executable, "-c", STARTUP], capture_output=True, text=True, env=user_env(PYTHONPATH=str(REPO)), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) >= 0.5


@pytest.mark.fast
def test_no_validation_set_writes_no_eval_record_and_prints_no_eval_line(tmp_path, capsys):
    from core.kernel.job import RunFolder
    from core.kernel.train import log_eval

    run = RunFolder(tmp_path, None, "ddp", {}, True)
    log_eval(run, {}, step=3, epoch=0)  # evaluate() of no loader
    assert capsys.readouterr().out == "" and not (tmp_path / "metrics.jsonl").exists()
    log_eval(run, {"val_loss": 0.5}, step=3, epoch=0)
    assert capsys.readouterr().out == "epoch 0 val_loss 0.5000\n"
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["kind"] == "eval"
