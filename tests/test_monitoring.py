"""Monitoring and debugging: metrics records, progress output, the hang watchdog, plots, --profile.

Also a test-only model factory: `--model test_monitoring:stall_mlp` with TDR_TEST_STALL=RANK:CALL:SECONDS
makes that rank's forward stop for SECONDS at its CALL-th call (an Event wait; core/ has no test hooks).
"""
import json
import os
import sys
import threading

import pytest
import torch

from core import watchdog
from core.metrics import PHASES, Meter
from core.models import MLP
from core.parallel import wrap_ddp
from core.run import RunWriter, progress_line
from core.steps import cross_entropy, step_plain
from helpers import REPO, run, user_env
from world import GlooWorld

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
        if int(os.environ.get("RANK", "0")) == rank and self.calls == call:
            threading.Event().wait(seconds)  # this rank stops; the others wait for it in the all-reduce
        return super().forward(x)


def stall_mlp():
    return StallMLP()


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2, timeout_s=90) as world:
        yield world


def metered_training(topo, steps):
    """Each rank trains on different data; returns what read() gave this rank, and its local loss sum."""
    torch.manual_seed(0)
    model = MLP(hidden=64, depth=2)
    ddp = wrap_ddp(model, device=topo.device, comm_hook="none")
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    meter = Meter(topo.device, flops_per_sample=1e6, peak_flops=1e12).attach(ddp, optimizer)
    gen = torch.Generator().manual_seed(topo.rank)
    local = 0.0
    for _ in range(steps):
        size = 8 + 4 * topo.rank  # ranks with different batch sizes: the sums must still combine exactly
        batch = torch.randn(size, 64, generator=gen), torch.randint(10, (size,), generator=gen)
        metrics = step_plain(ddp, batch, optimizer=optimizer, loss_fn=cross_entropy)
        local += metrics["loss_sum"].item()
        meter.add(metrics)
    return meter.read(loss_scale=1024.0 * (topo.rank + 1)), local


def test_metrics_records_carry_their_fields_and_every_rank_agrees(world2):
    (first, local0), (second, local1) = world2.run(metered_training, 6)
    assert first == second  # every number is the job's, not one rank's
    wanted = {"loss", "acc", "samples_per_s", "peak_mem_mb", "grad_norm", "loss_scale", "mfu", "step_ms_max",
              *(f"{p}_ms" for p in PHASES)}
    assert wanted <= first.keys()
    assert first["loss"] == pytest.approx((local0 + local1) / (6 * (8 + 12)))  # both ranks' samples, weighted
    assert first["loss_scale"] == 1536.0  # averaged over ranks
    assert first["mfu"] == pytest.approx(1e6 * first["samples_per_s"] / (1e12 * 2))
    parts = sum(first[f"{p}_ms"] for p in ("data", "compute", "comm_wait", "optimizer"))
    assert first["step_ms"] == pytest.approx(parts, rel=1e-6) and first["comm_wait_ms"] > 0
    assert first["step_ms_max"] >= first["step_ms"] > 0 and first["peak_mem_mb"] > 0 and first["grad_norm"] > 0


def test_meter_keeps_its_old_api_without_attach():
    meter = Meter(torch.device("cpu"))
    assert meter.read()["samples_per_s"] == 0.0  # nothing yet: the placeholder record
    meter.add({"loss_sum": torch.tensor(6.0), "correct": torch.tensor(1.0), "count": torch.tensor(3.0)})
    record = meter.read()
    assert record["loss"] == 2.0 and record["acc"] == pytest.approx(1 / 3) and "step_ms" not in record
    assert meter.samples_per_s > 0


def test_progress_is_a_bar_on_a_terminal_and_log_lines_otherwise(tmp_path, capsys):
    assert progress_line(40, 115, width=8, epoch=1, loss=0.41234, samples_per_s=1875.4) == \
        "step 40/115 [###-----]  35% epoch 1 loss 0.4123 1875 samples/s"
    tty = RunWriter(tmp_path, enabled=True, tty=True)
    for step in range(1, 4):
        tty.progress(step, 3, every=2, loss=1.0)
    out = capsys.readouterr().out
    assert out.startswith("\r") and "step 3/3 [" in out and "\n" not in out  # redrawn in place
    lines = []
    from loguru import logger
    sink = logger.add(lines.append, format="{message}")
    try:
        plain = RunWriter(tmp_path, enabled=True, tty=False)
        for step in range(1, 6):
            plain.progress(step, 5, every=2, loss=1.0, samples_per_s=10.0)
        RunWriter(tmp_path, enabled=False, tty=False).progress(2, 5, every=2)  # not rank 0: silent
    finally:
        logger.remove(sink)
    assert [line.strip() for line in lines] == [f"step {s}/5 loss 1.0000 10 samples/s" for s in (2, 4, 5)]
    assert capsys.readouterr().out == ""


def test_behind_names_the_rank_with_fewest_collectives():
    infos = {0: {"step": 7, "issued": 30}, 1: {"step": 7, "issued": 28}, 2: {"step": 7, "issued": 30}}
    report = watchdog.behind(infos, world_size=4)
    assert report["behind"] == [1] and report["silent"] == [3] and "rank(s) 1 behind" in report["message"]
    assert watchdog.behind({0: {"step": 3, "issued": 9}}, world_size=1)["behind"] == [0]


def test_watchdog_fires_on_a_stalled_rank_and_names_it(tmp_path):
    """Rank 1 stops in forward for 8 s; every rank writes its stack, rank 0 says rank 1 is behind."""
    env = user_env(PYTHONPATH=TESTS, TDR_TEST_STALL="1:12:8")
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "recipes", "run", "ddp", "--model", "test_monitoring:stall_mlp", "--max-steps", "18",
                "--hang-factor", "3", "--hang-min-s", "1", "--out", str(tmp_path), "--timeout-s", "60"],
               env=env, timeout=180)
    run_dir = next(tmp_path.glob("ddp-*"))
    report = json.loads((run_dir / "hang-report.json").read_text())
    assert report["behind"] == [1] and report["silent"] == [], report
    assert report["ranks"]["0"]["issued"] > report["ranks"]["1"]["issued"]
    stacks = {r: (run_dir / f"hang-rank{r}.txt").read_text() for r in (0, 1)}
    assert "in forward" in stacks[1] and "test_monitoring.py" in stacks[1]  # where rank 1 stopped
    assert "gloo:all_reduce" in stacks[0].splitlines()[0]  # rank 0's last collective, waiting for rank 1
    assert "rank(s) 1 behind" in proc.stderr
    assert '"kind": "summary"' in (run_dir / "metrics.jsonl").read_text()  # the stall passed; the run finished


def test_profile_writes_a_trace_per_rank_and_debug_sets_the_environment(tmp_path, monkeypatch):
    run([sys.executable, "-m", "recipes", "run", "ddp", "--model", "tiny:mlp", "--max-steps", "12", "--profile",
         "--debug", "--out", str(tmp_path)], env=user_env(PYTHONPATH=TESTS))
    trace = json.loads(next(tmp_path.glob("ddp-*/profile/rank0.json")).read_text())
    assert any("ProfilerStep" in e.get("name", "") for e in trace["traceEvents"])
    monkeypatch.setattr(os, "environ", {"TORCH_FR_BUFFER_SIZE": "7"})
    set_now = watchdog.prepare_env(debug=True, out=str(tmp_path))
    assert set_now["TORCH_FR_BUFFER_SIZE"] == "7"  # the user's own setting wins
    gpu = torch.cuda.is_available()
    assert set_now["TORCH_DISTRIBUTED_DEBUG"] == ("DETAIL" if gpu else "INFO")  # DETAIL + gloo + DDP segfaults
    assert ("TORCH_NCCL_DUMP_ON_TIMEOUT" in set_now) == gpu


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
