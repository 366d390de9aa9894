"""Step time of a 2-node x 2-process ddp job over an unlimited link and over a slow one.

    sudo python bench/bench_slow_link.py                    # 50mbit vs unlimited, 30 steps
    sudo python bench/bench_slow_link.py --rate 10mbit --steps 60 --model cnn

The two "nodes" are network namespaces joined by a veth pair (tests/netns.py); the slow link
is a token-bucket filter (tc tbf) on both ends. Each run goes through launch_multi_node.sh, as
a user would start it; the step time is the median gap between rank 0's train records, whose
`elapsed_s` every rank agrees on (metrics are reduced). Root only (namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import netns  # noqa: E402  (the test harness, reused)


def run_job(net: netns.TwoHosts, out: Path, recipe_args: list[str], *, timeout: float) -> list[float]:
    """Both nodes to the end; returns the step times (s) rank 0 logged."""
    a, _ = net.hosts
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(OMP_NUM_THREADS="1", NNODES="2", NPROC_PER_NODE="2", MASTER_ADDR=a.addr, MASTER_PORT="29500")
    procs = [
        net.popen(
            host,
            [str(REPO / "launch_multi_node.sh"), "ddp", *recipe_args, "--out", str(out)],
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for rank, host in enumerate(net.hosts)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=timeout)
        if proc.returncode:
            raise SystemExit(f"error: the job failed:\n{err[-2000:]}")
    (metrics,) = out.glob("*/metrics.jsonl")
    times = [r["elapsed_s"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    return [later - earlier for earlier, later in zip(times, times[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="50mbit", help="tc tbf rate of the slow link")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a job may take")
    args = parser.parse_args()
    if why := netns.unavailable():
        raise SystemExit(f"error: {why}")
    recipe_args = [
        "--model",
        args.model,
        "--epochs",
        "100",
        "--max-steps",
        str(args.steps),
        "--batch-size",
        "8",
        "--log-every",
        "1",
        "--timeout-s",
        "120",
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, rate in (("unlimited", None), (args.rate, args.rate)):
            with netns.TwoHosts() as net:
                for host in net.hosts if rate else ():
                    net.shape(host, rate=rate)
                steps = run_job(net, Path(tmp) / label, recipe_args, timeout=args.timeout)
            results[label] = statistics.median(steps[1:] or steps)  # the first step includes warm-up
    base = results["unlimited"]
    print(f"{'link':<12} {'step time (ms)':>15} {'vs unlimited':>13}")
    for label, step in results.items():
        print(f"{label:<12} {step * 1e3:>15.1f} {step / base:>12.2f}x")


if __name__ == "__main__":
    main()
