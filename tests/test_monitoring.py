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
from torch.nn.parallel import DistributedDataParallel

from core import watchdog
from core.meter import progress_line
from core.metrics import PHASES
from core.models import MLP
from core.monitor import Monitor
from core.run import Run
from core.steps import make_loss, train_step
from helpers import REPO, run, torchrun, user_env

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


def monitored_training(topo, out, steps):
    """Each rank trains on different data through ddp_monitored's pieces; returns the train record rank 0 wrote."""
    from recipes.ddp_monitored import Config

    os.environ["TDR_PEAK_TFLOPS"] = "1"  # a made-up peak, so that MFU is computed on CPU
    torch.manual_seed(0)
    cfg = Config(out=out, log_every=steps, hang_factor=0, model="tiny:mlp")
    sizes = [8 + 4 * r for r in range(topo.world_size)]  # ranks with different batch sizes: sums combine exactly
    with Run.start(cfg, topo, recipe="ddp_monitored", global_batch=sum(sizes)) as run:
        model = MLP(hidden=32, depth=2)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(topo.rank)
        local = 0.0
        with Monitor(run, ddp, optimizer, cfg=cfg, sample=(torch.zeros(64), 0)) as monitor:
            for step in range(1, steps + 1):
                batch = (
                    torch.randn(sizes[topo.rank], 64, generator=gen),
                    torch.randint(10, (sizes[topo.rank],), generator=gen),
                )
                metrics, stats = train_step(ddp, [batch], optimizer=optimizer, loss_fn=make_loss("ce"))
                local += metrics["loss_sum"].item()
                run.step(step, metrics=metrics, stats=stats, lr=1e-3, total=steps, **monitor.step(step))
    metrics_file = run.run_dir / "metrics.jsonl"  # rank 0 writes it; every rank returns what it says
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()] if topo.is_rank0 else []
    return [r for r in records if r["kind"] == "train"], local


def test_train_records_carry_the_breakdown_and_speak_for_every_rank(world2, tmp_path):
    (records, local0), (_, local1) = world2.run(monitored_training, str(tmp_path), 6)
    first = records[0]
    wanted = {
        "loss",
        "acc",
        "samples_per_s",
        "peak_mem_mb",
        "grad_norm",
        "mfu",
        "step_ms_max",
        *(f"{p}_ms" for p in PHASES),
    }
    assert wanted <= first.keys()
    assert first["loss"] == pytest.approx((local0 + local1) / (6 * (8 + 12)))  # both ranks' samples, weighted
    parts = sum(first[f"{p}_ms"] for p in ("data", "compute", "comm_wait", "optimizer"))
    assert first["step_ms"] == pytest.approx(parts, rel=1e-6) and first["comm_wait_ms"] > 0
    assert first["step_ms_max"] >= first["step_ms"] > 0 and first["peak_mem_mb"] > 0 and first["grad_norm"] > 0
    assert 0 < first["mfu"]


def test_the_progress_line_names_the_step_and_the_job_numbers():
    assert progress_line(40, 115, epoch=1, loss=0.41234, acc=0.5, samples_per_s=1875.4, tokens_per_s=9e4) == (
        "step 40/115 epoch 1 loss 0.4123 acc 0.5000 1875 samples/s 90000 tokens/s"
    )
    assert progress_line(1, 2, epoch=0) == "step 1/2 epoch 0"  # nothing read yet


def test_behind_names_the_rank_with_fewest_collectives():
    infos = {0: {"step": 7, "issued": 30}, 1: {"step": 7, "issued": 28}, 2: {"step": 7, "issued": 30}}
    report = watchdog.behind(infos, world_size=4)
    assert report["behind"] == [1] and report["silent"] == [3] and "rank(s) 1 behind" in report["message"]
    assert watchdog.behind({0: {"step": 3, "issued": 9}}, world_size=1)["behind"] == [0]


def test_watchdog_fires_on_a_stalled_rank_and_names_it(tmp_path):
    """Rank 1 stops in forward for 8 s; every rank writes its stack, rank 0 says rank 1 is behind."""
    env = user_env(PYTHONPATH=TESTS, TDR_TEST_STALL="1:12:8")
    proc = run(
        torchrun(
            "-m",
            "recipes",
            "run",
            "ddp_monitored",
            "--model",
            "test_monitoring:stall_mlp",
            "--max-steps",
            "18",
            "--hang-factor",
            "3",
            "--hang-min-s",
            "1",
            "--out",
            str(tmp_path),
            "--timeout-s",
            "60",
        ),
        env=env,
        timeout=180,
    )
    run_dir = next(tmp_path.glob("ddp_monitored-*"))
    report = json.loads((run_dir / "hang-report.json").read_text())
    assert report["behind"] == [1] and report["silent"] == [], report
    assert report["ranks"]["0"]["issued"] > report["ranks"]["1"]["issued"]
    stacks = {r: (run_dir / f"hang-rank{r}.txt").read_text() for r in (0, 1)}
    assert "in forward" in stacks[1] and "test_monitoring.py" in stacks[1]  # where rank 1 stopped
    assert "gloo:all_reduce" in stacks[0].splitlines()[0]  # rank 0's last collective, waiting for rank 1
    assert "rank(s) 1 behind" in proc.stderr
    assert '"kind": "summary"' in (run_dir / "metrics.jsonl").read_text()  # the stall passed; the run finished


def test_profile_writes_a_trace_per_rank_and_debug_sets_the_environment(tmp_path, monkeypatch):
    run(
        [
            sys.executable,
            "-m",
            "recipes",
            "run",
            "ddp_monitored",
            "--model",
            "tiny:mlp",
            "--max-steps",
            "12",
            "--profile",
            "--debug",
            "--out",
            str(tmp_path),
        ],
        env=user_env(PYTHONPATH=TESTS),
    )
    trace = json.loads(next(tmp_path.glob("ddp_monitored-*/profile/rank0.json")).read_text())
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
