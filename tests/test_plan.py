"""The memory plan (`python -m recipes plan`, tools/plan*.py): right against torch's tracker on real steps, for
every recipe on the built-in GPT, a transformers GPT-2 and Llama at 1 and 2 ranks; its table, JSON and fit; and
one line, nothing created, for what it cannot plan and for bad input."""

import json
import os

import pytest
from plan_models import MATRIX

from core.config import RecipeError, parse_args
from tools.cli import run_cli
from tools.plan import plan_recipe
from tools.plan_measure import measure
from tools.registry import RECIPES

EXACT = ("params_bytes", "grads_bytes", "optimizer_bytes")


def _cfg(name: str, args: list[str]):
    return parse_args(RECIPES[name].load().Config, list(args), prog=name)[0]


def _against_measurement(world, size: int) -> list[str]:
    wrong = []
    for name, args in MATRIX[size]:
        plan = plan_recipe(name, _cfg(name, args), world_size=size, gpu=False)
        for rank, measured in enumerate(world.run(measure, name, args)):
            planned = plan.ranks[rank]
            off = planned.peak_bytes / measured["peak_bytes"] - 1
            inexact = {k: (getattr(planned, k), measured[k]) for k in EXACT if getattr(planned, k) != measured[k]}
            if inexact or abs(off) > 0.10:
                wrong.append(f"{name} {' '.join(args)} rank {rank}: peak {off:+.1%}, {inexact}")
    return wrong


@pytest.mark.world
def test_plan_matches_real_steps_on_one_rank(world1):
    """Parameters, gradients and optimizer state to the byte; the peak within 10% of MemTracker's on real steps."""
    assert _against_measurement(world1, 1) == []


@pytest.mark.world
def test_plan_matches_real_steps_on_two_ranks(world2):
    assert _against_measurement(world2, 2) == []


@pytest.mark.fast
def test_json_is_exactly_the_documented_shape(capsys):
    assert (
        run_cli(["plan", "ddp", "--model", "gpt", "--data", "text", "--batch-size", "2", "--nproc", "2", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"recipe", "world_size", "ranks"} and (out["recipe"], out["world_size"]) == ("ddp", 2)
    keys = {"rank", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"}
    assert [set(r) for r in out["ranks"]] == [keys, keys] and [r["rank"] for r in out["ranks"]] == [0, 1]
    from core.gpt import gpt

    params = sum(p.numel() * 4 for p in gpt().parameters())  # fp32, a whole replica on each rank
    assert out["ranks"][0]["params_bytes"] == params and out["ranks"][0]["optimizer_bytes"] > 2 * params


@pytest.mark.fast
def test_table_puts_the_largest_rank_first_and_names_what_dominates(capsys):
    assert run_cli(["plan", "pipeline", "--batch-size", "4", "--microbatches", "4", "--nproc", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pipeline on 2 ranks, GiB per rank" and lines[1].split()[0] == "ranks"
    plan = plan_recipe("pipeline", _cfg("pipeline", ["--batch-size", "4", "--microbatches", "4"]), world_size=2)
    assert lines[2].split()[0] == str(plan.largest.rank) and "activations (" in lines[2]
    # 1F1B: the first stage keeps as many micro-batches in flight as there are stages, the last one
    assert "  rank 0: micro-batches in flight: 2 of 4" in lines and "  rank 1: micro-batches in flight: 1 of 4" in lines


@pytest.mark.fast
def test_a_plan_that_does_not_fit_says_what_would_each_from_a_plan(capsys):
    args = ["--model", "gpt", "--data", "text", "--batch-size", "8", "--accum", "1"]
    cfg = _cfg("ddp_amp", args)
    peak = plan_recipe("ddp_amp", cfg, world_size=1).largest.peak_bytes
    device = peak * 0.8 / 2**30
    assert run_cli(["plan", "ddp_amp", *args, "--device-memory", f"{device:.6f}"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: plan: rank 0's peak") and "would fit:" in err
    from tools.plan_report import gib

    smaller = _cfg("ddp_amp", [*args[:-3], "4", "--accum", "2"])  # --device-memory plans for a GPU
    figure = gib(plan_recipe("ddp_amp", smaller, world_size=1, gpu=True).largest.peak_bytes)
    assert f"--batch-size 4 --accum 2 ({figure} GiB)" in err  # a figure from a plan
    assert "fsdp (" in err and "ddp_monitored --activation-checkpointing (" in err


@pytest.mark.fast
@pytest.mark.parametrize(
    "args, says",
    [
        (["nope"], "unknown recipe 'nope'"),
        (["ddp", "--accum", "2"], "--accum: ddp does not take it"),
        (["ddp", "--model", "plan_models:broken"], "the factory raised ValueError"),
        (["ddp", "--device-memory", "-8"], "--device-memory -8"),
        (["ddp", "--nproc", "0"], "--nproc 0"),
        (["ddp", "--nproc", "100000"], "--nproc 100000: use 1 to 65536 processes"),  # issue 36: the range it takes
        (["ddp", "--nproc", "eight"], "--nproc eight: use 1 to 65536 processes"),
        (["dp", "--nproc", "2"], "dp runs one process"),
        (["ddp_monitored", "--compile"], "cannot plan --compile"),
        (["ddp", "--model", "plan_models:reads_value", "--data", "text"], "forward of gate (Gate)"),
        (["ddp", "--model", "plan_models:data_shape", "--data", "text"], "nonzero"),
        (["ddp", "--model", "plan_models:numpy_function", "--data", "text"], "numpy"),
    ],
)
def test_bad_input_and_what_cannot_be_planned_are_one_line_and_create_nothing(args, says, tmp_path, capsys):
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert run_cli(["plan", *args]) != 0
    finally:
        os.chdir(here)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fast
def test_the_pre_check_prints_the_peak_and_refuses_a_job_over_free_memory(monkeypatch, capsys):
    from tools import plan_report

    cfg = _cfg("ddp", ["--model", "gpt", "--data", "text", "--batch-size", "2"])
    plan_report.precheck_memory("ddp", cfg, world_size=2)
    assert capsys.readouterr().err.startswith("plan: largest peak ")
    monkeypatch.setattr(plan_report, "_mem_available", lambda: 2**20)  # 1 MiB available: two ranks cannot fit
    with pytest.raises(RecipeError, match=r"rank 0's peak .* does not fit this machine's available memory"):
        plan_report.precheck_memory("ddp", cfg, world_size=2)


@pytest.mark.fast
def test_the_launchers_pre_check_runs_the_plan(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_cli(["run", "fsdp", "--batch-size", "2", "--dry-run"]) == 0
    assert "plan: largest peak" in capsys.readouterr().err


@pytest.mark.fast
def test_free_memory_is_per_gpu_the_least_free_device_or_the_cpus_available_shared(monkeypatch):
    import torch

    from tools import plan_report

    monkeypatch.setattr(plan_report, "_mem_available", lambda: 64 * 2**30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    assert plan_report.free_bytes(world_size=4) == (64 * 2**30, "this machine's available memory for 4 ranks", 4)
    monkeypatch.setenv("NPROC_PER_NODE", "2")  # a multi-node job: this node runs 2 of the 4 ranks
    assert plan_report.free_bytes(world_size=4)[2] == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: ((70, 60)[i] * 2**30, 80 * 2**30))
    monkeypatch.delenv("TDR_DEVICE", raising=False)
    assert plan_report.free_bytes(world_size=4) == (60 * 2**30, "the free memory of the GPUs", 1)
