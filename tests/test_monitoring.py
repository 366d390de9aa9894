"""Monitoring and debugging (ddp_monitored): the step-time breakdown in the train records, the progress line, the
hang watchdog, the profiler, --debug's environment, plots.

Also a test-only model factory: `--model test_monitoring:stall_mlp` with TDR_TEST_STALL=RANK:CALL:SECONDS
makes that rank's forward stop for SECONDS at its CALL-th call (an Event wait; core/ has no test hooks).
"""

import json
import os
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from core import monitor
from core.kernel.builtin import MLP
from core.kernel.job import RunFolder
from core.kernel.loss import Loss
from core.kernel.seams import SEAMS
from core.kernel.step import step_plain
from core.kernel.store import open_run
from core.kernel.train import Tally, log_train
from core.plugins import meter, watchdog
from helpers import REPO, checkpoints, run, user_env
from recipes import ddp_monitored

TESTS = str(REPO / "tests")


class StallMLP(MLP):
    def __init__(self):
        super().__init__(hidden=64, depth=2)
        self.calls = 0
        rank, call, seconds = os.environ.get("TDR_TEST_STALL", "-1:0:0").split(":")
        self.stall = int(rank), int(call), float(seconds)

    def forward(self, x):
        self.calls += 1
        rank, call, seconds = self.stall
        if (dist.get_rank() if dist.is_initialized() else 0) == rank and self.calls == call:
            threading.Event().wait(seconds)  # this rank stops; the others wait for it in the all-reduce
        return super().forward(x)


def stall_mlp():
    return StallMLP()


def monitored_training(topo, out, steps):
    """Each rank trains on different data with ddp_monitored's step clock; returns the train records rank 0 wrote."""
    torch.manual_seed(0)
    cfg = ddp_monitored.Config(out=out, model="tiny:mlp")
    sizes = [8 + 4 * r for r in range(topo.world_size)]  # ranks with different batch sizes: sums combine exactly
    run_folder = open_run(cfg, topo, recipe="ddp_monitored", global_batch=sum(sizes))
    model = MLP(hidden=32, depth=2)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    totals, timer, loss_fn = Tally(topo.device), monitor.StepClock(ddp, optimizer, topo.device), Loss()
    meter.clock_reset(cfg, run_folder)  # the training clock's start, as the kernel's open_run starts it
    gen = torch.Generator().manual_seed(topo.rank)
    local = 0.0
    for _ in range(steps):
        if topo.rank == 1:
            threading.Event().wait(0.02)  # rank 1's data comes late: its data phase differs from rank 0's
        batch = (
            torch.randn(sizes[topo.rank], 64, generator=gen),
            torch.randint(10, (sizes[topo.rank],), generator=gen),
        )
        metrics, grad_norm = step_plain(ddp, batch, optimizer=optimizer, loss_fn=loss_fn)
        local += metrics["loss_sum"].item()
        totals.add(metrics)
        meter.clock_step(metrics)  # as the recipe's SEAMS["on_step"] hooks run it
    mine = timer.take()
    timing = monitor.breakdown(mine, topo.device, sum(sizes), 1e6, 1e12)
    log_train(run_folder, totals, step=steps, total=steps, epoch=0, grad_norm=grad_norm, **timing)
    if topo.rank != 0:  # rank 0 writes the records; every rank returns what it trained on and timed
        return [], local, mine
    written = [json.loads(line) for line in (run_folder.path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in written if r["kind"] == "train"], local, mine


def open_where_rank_0_cannot_write(topo, out):
    """open_run with an --out rank 0 cannot make (a file on its path): what each rank raised."""
    cfg = ddp_monitored.Config(out=out)
    try:
        open_run(cfg, topo, recipe="ddp", global_batch=2)
    except Exception as err:  # noqa: BLE001 - the test wants to see what each rank raised
        return type(err).__name__, str(err)
    return None


@pytest.mark.world
def test_an_out_rank_0_cannot_write_is_one_line_on_every_rank_none_left_waiting(world2, tmp_path):
    """Bare torchrun (no pre-check) with a bad --out: rank 0's OSError reaches every rank as one RecipeError line
    naming the folder; before, rank 0 raised alone and rank 1 died in the broadcast with a traceback."""
    (tmp_path / "a-file").write_text("not a folder")
    said = world2.run(open_where_rank_0_cannot_write, str(tmp_path / "a-file" / "runs"))
    assert said[0] == said[1] and said[0][0] == "RecipeError", said
    assert "a-file" in said[0][1] and "check the folder" in said[0][1] and "\n" not in said[0][1]


@pytest.mark.world
def test_train_records_carry_the_breakdown_and_speak_for_every_rank(world2, tmp_path):
    (records, local0, mine0), (_, local1, mine1) = world2.run(monitored_training, str(tmp_path), 6)
    first = records[0]
    assert mine0["steps"] == mine1["steps"] == 6
    for phase in monitor.PHASES:  # each phase: the mean over the ranks of each rank's mean step
        assert first[f"{phase}_ms"] == pytest.approx((mine0[phase] + mine1[phase]) / 12, rel=1e-9)
    assert first["step_ms_max"] == pytest.approx(max(mine0["step"], mine1["step"]) / 6, rel=1e-9)
    assert mine1["data"] > mine0["data"]  # rank 1's late data is in the job's record, not rank 0's alone
    wanted = {"loss", "acc", "samples_per_s", "peak_mem_mb", "grad_norm", "mfu", "step_ms_max"}
    assert wanted | {f"{p}_ms" for p in monitor.PHASES} <= first.keys()
    assert first["loss"] == pytest.approx((local0 + local1) / (6 * (8 + 12)))  # both ranks' samples, weighted
    parts = sum(first[f"{p}_ms"] for p in ("data", "compute", "comm_wait", "optimizer"))
    assert first["step_ms"] == pytest.approx(parts, rel=1e-6) and first["comm_wait_ms"] > 0
    assert first["step_ms_max"] >= first["step_ms"] > 0 and first["peak_mem_mb"] > 0 and first["grad_norm"] > 0
    assert first["mfu"] == pytest.approx(1e6 * 10 / (first["step_ms"] / 1e3) / 1e12)  # 20 samples over 2 ranks


@pytest.mark.fast
def test_the_progress_line_names_the_step_and_the_job_numbers(tmp_path, capsys, monkeypatch):
    run_folder = RunFolder(tmp_path, None, "ddp_monitored", {}, True)
    monkeypatch.setitem(SEAMS, "log_fields", [lambda: {"samples_per_s": 1875.4, "tokens_per_s": 9e4}])
    sums = {"loss_sum": 4.1234, "count": 10.0, "correct": 5.0, "scored": 10.0}  # the window, reduced over the ranks
    window = SimpleNamespace(sums={}, last={}, reduce=lambda: sums)
    log_train(run_folder, window, step=40, total=115, epoch=1, step_ms=3.0)
    assert capsys.readouterr().out == "step 40/115 epoch 1 loss 0.4123 acc 0.5000 1875 samples/s 90000 tokens/s\n"
    monkeypatch.setitem(SEAMS, "log_fields", [])
    log_train(run_folder, SimpleNamespace(sums={}, last={}, reduce=lambda: {"count": 0.0}), step=1, total=2, epoch=0)
    assert capsys.readouterr().out == "step 1/2 epoch 0\n"  # nothing read yet


@pytest.mark.fast
def test_the_ms_line_says_where_a_step_went_and_the_slowest_rank():
    record = {"data_ms": 1.25, "compute_ms": 7.5, "comm_wait_ms": 13.0, "optimizer_ms": 11.25, "step_ms": 33.0}
    record |= {"step_ms_max": 1040.0, "peak_mem_mb": 389.1}
    assert monitor.ms_line(record) == (
        "ms per step: 33.0 mean, 1040.0 on the slowest rank (data 1.2, compute 7.5, comm wait 13.0, optimizer 11.2); "
        "peak memory 389 MB"
    )
    assert monitor.ms_line(record | {"mfu": 0.4123}).endswith("; peak memory 389 MB; MFU 41.2%")  # a known GPU


@pytest.mark.fast
def test_behind_names_the_rank_with_fewest_collectives():
    infos = {0: {"step": 7, "issued": 30}, 1: {"step": 7, "issued": 28}, 2: {"step": 7, "issued": 30}}
    report = watchdog.behind(infos, world_size=4)
    assert report["behind"] == [1] and report["silent"] == [3] and "rank(s) 1 behind" in report["message"]
    assert watchdog.behind({0: {"step": 3, "issued": 9}}, world_size=1)["behind"] == [0]


def stalled_recipe_run(topo, out):
    """ddp_monitored's train on 2 ranks; rank 1 stops in forward at step 12 for 6 s; the profiler traces steps 6-9."""
    os.environ["TDR_TEST_STALL"] = "1:12:6"
    os.environ["TDR_PEAK_TFLOPS"] = "1"  # a made-up peak, so that MFU is computed on CPU
    try:
        cfg = ddp_monitored.Config(
            model="test_monitoring:stall_mlp",
            max_steps=18,
            log_every=6,
            hang_factor=3,
            hang_min_s=2,
            timeout_s=60,
            profile=True,
            out=out,
        )
        return ddp_monitored.train(cfg, topo)
    finally:
        del os.environ["TDR_TEST_STALL"], os.environ["TDR_PEAK_TFLOPS"]


@pytest.fixture(scope="module")
def stalled(world2, tmp_path_factory):
    out = tmp_path_factory.mktemp("stalled")
    world2.run(stalled_recipe_run, str(out))
    return next(out.glob("ddp_monitored-*"))


@pytest.mark.world
def test_watchdog_fires_on_a_stalled_rank_and_names_it(stalled):
    """Rank 1 stops in forward; every rank writes its stack, rank 0 says rank 1 is behind; the run then finishes."""
    report = json.loads((stalled / "hang-report.json").read_text())
    assert report["behind"] == [1] and report["silent"] == [], report
    assert "rank(s) 1 behind" in report["message"]
    assert report["ranks"]["0"]["issued"] > report["ranks"]["1"]["issued"]
    stacks = {r: (stalled / f"hang-rank{r}.txt").read_text() for r in (0, 1)}
    assert "in forward" in stacks[1] and "test_monitoring.py" in stacks[1]  # where rank 1 stopped
    assert "gloo:all_reduce" in stacks[0].splitlines()[0]  # rank 0's last collective, waiting for rank 1
    assert '"kind": "summary"' in (stalled / "metrics.jsonl").read_text()  # the stall passed; the run finished
    warned = [line for line in (stalled / "train.log").read_text().splitlines() if "| WARNING | rank 0 |" in line]
    assert any("warning: watchdog: rank(s) 1 behind" in line for line in warned), warned  # train.log has it too


@pytest.mark.world
def test_the_recipe_writes_the_breakdown_and_a_profile_trace_per_rank(stalled):
    records = [json.loads(line) for line in (stalled / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [6, 12, 18]
    for record in train:
        assert {"step_ms_max", "peak_mem_mb", "grad_norm", "mfu", *(f"{p}_ms" for p in monitor.PHASES)} <= record.keys()
    assert train[1]["step_ms_max"] > 1000  # the window of the stall: rank 1's stalled step (6 s over 6 steps)
    said = [line.split(" | rank 0 | ")[1] for line in (stalled / "train.log").read_text().splitlines()]
    lines = [line for line in said if line.startswith("ms per step: ")]  # one under each progress line
    assert [said[said.index(line) - 1].split()[1] for line in lines] == ["6/18", "12/18", "18/18"], said
    assert lines == [monitor.ms_line(record) for record in train]  # the record's numbers, as the record has them
    for rank in (0, 1):
        trace = json.loads((stalled / "profile" / f"rank{rank}.json").read_text())
        assert any("ProfilerStep" in e.get("name", "") for e in trace["traceEvents"])


@pytest.mark.fast
def test_debug_sets_the_environment_the_process_group_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", {"TORCH_FR_BUFFER_SIZE": "7"})
    set_now = watchdog.prepare_env(debug=True, out=str(tmp_path))
    assert set_now["TORCH_FR_BUFFER_SIZE"] == "7"  # the user's own setting wins
    gpu = torch.cuda.is_available()
    assert set_now["TORCH_DISTRIBUTED_DEBUG"] == ("DETAIL" if gpu else "INFO")  # DETAIL + gloo + DDP segfaults
    assert ("TORCH_NCCL_DUMP_ON_TIMEOUT" in set_now) == gpu
    assert watchdog.prepare_env(debug=False, out=str(tmp_path), watchdog=False) == {}


@pytest.mark.fast
def test_the_runner_sets_debugs_environment_before_it_joins_the_group(tmp_path, monkeypatch):
    """Under the single-node launcher tools/join.py makes the group before main: --debug's environment must be
    set first, or NCCL never reads it."""
    from click.testing import CliRunner

    import tools.join
    from tools.cli import cli

    monkeypatch.setattr(os, "environ", {"RANK": "0", "TDR_PRECHECKED": "1"})  # a worker the launcher checked
    seen = {}
    monkeypatch.setattr(tools.join, "join", lambda **_: seen.update(os.environ))
    monkeypatch.setattr(ddp_monitored, "main", lambda cfg: None)
    result = CliRunner().invoke(cli, ["run", "ddp_monitored", "--debug", "--model", "tiny:mlp", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen["TORCH_DISTRIBUTED_DEBUG"] and seen["TORCH_FR_BUFFER_SIZE"] == "2000"


def test_the_command_line_runs_main_with_debug_profile_and_async_checkpoints(tmp_path):
    """One process through `python -m recipes run`: the pre-check, main's environment, init_pg and train."""
    args = ["--model", "tiny:mlp", "--max-steps", "12", "--profile", "--debug", "--ckpt-every", "6", "--ckpt-async"]
    run(
        [sys.executable, "-m", "recipes", "run", "ddp_monitored", *args, "--out", str(tmp_path)],
        env=user_env(PYTHONPATH=TESTS),
    )
    run_dir = next(tmp_path.glob("ddp_monitored-*"))
    trace = json.loads((run_dir / "profile" / "rank0.json").read_text())
    assert any("ProfilerStep" in e.get("name", "") for e in trace["traceEvents"])
    assert [p.name for p in checkpoints(run_dir / "ckpt")] == [
        "step-000006.safetensors",
        "step-000012.safetensors",
    ]


def _records(folder, steps, throughput):
    folder.mkdir()
    lines = [{"kind": "train", "step": s, "loss": 2 / s, "samples_per_s": throughput} for s in range(1, steps + 1)]
    lines += [{"kind": "eval", "step": s, "val_acc": 0.5 + s / 100} for s in (5, 10)]
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + '\n{"kind": "tra')  # torn last line


def test_plot_writes_a_png_of_several_runs(tmp_path):
    pytest.importorskip("matplotlib")  # not in install_requires: `pip install matplotlib` for the plot command
    _records(tmp_path / "a", 10, 1000.0)
    _records(tmp_path / "b", 8, 1500.0)
    out = tmp_path / "plots" / "runs.png"
    proc = run([sys.executable, "-m", "recipes", "plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)])
    assert str(out) in proc.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib import image

    height, width, _ = image.imread(out).shape
    assert width > height > 100
    missing = run([sys.executable, "-m", "recipes", "plot", str(tmp_path / "nope")], check=False)
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "metrics.jsonl" in missing.stderr
    text = run(
        [sys.executable, "-m", "recipes", "plot", str(tmp_path / "a"), "-o", str(tmp_path / "x.txt")], check=False
    )
    assert (
        text.returncode == 1
        and text.stderr == f"error: -o {tmp_path / 'x.txt'}: matplotlib cannot write .txt; use .png, .svg or .pdf\n"
    )
