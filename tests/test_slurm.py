"""launch_slurm.sbatch in a faked SLURM job: SLURM's variables set, scontrol and srun stubbed.

The stub srun starts one task per node at once, as SLURM does, each with its SLURM_NODEID;
the stub getent makes the job's node names mean 127.0.0.1; the stub torchrun records what it
was given (and node 0's stub listens on the rendezvous port, as the real one would, so that
node 1's launcher finds it there).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from helpers import REPO, free_port, run, user_env

STUBS = {
    "scontrol": """#!/usr/bin/env bash
[[ "$1 $2 $3" == "show hostnames node[01-02]" ]] || { echo "unexpected scontrol $*" >&2; exit 1; }
printf 'node01\\nnode02\\n'
""",
    "srun": """#!/usr/bin/env bash
echo "$@" > "$RECORD/srun.args"
nodes=$SLURM_JOB_NUM_NODES
while [[ "$1" == --* ]]; do [[ "$1" == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
for (( node = 0; node < nodes; node++ )); do
  SLURM_NODEID=$node SLURMD_NODENAME=node0$((node + 1)) "$@" > "$RECORD/node$node.out" 2>&1 &
done
status=0
for job in $(jobs -p); do wait "$job" || status=$?; done
exit $status
""",
    "getent": """#!/usr/bin/env bash
[[ "$2" == node0[12] ]] && echo "127.0.0.1       STREAM $2" || exec /usr/bin/getent "$@"
""",
    "torchrun": """#!/usr/bin/env python3
import json, os, socket, sys, time
args = sys.argv[1:]
keep = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
node = args[args.index("--node-rank") + 1]
with open(os.path.join(os.environ["RECORD"], f"torchrun.{node}.json"), "w") as f:
    json.dump({"args": args, "env": {k: os.environ.get(k) for k in keep}}, f)
if node == "0" and os.environ["NNODES"] != "1":  # stand in for the rendezvous store until node 1 has seen it
    server = socket.create_server(("", int(os.environ["MASTER_PORT"])))
    server.settimeout(60)
    server.accept()
""",
}


def fake_slurm(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, text in STUBS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    slurm = dict(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_SUBMIT_DIR=str(REPO),
        NPROC_PER_NODE="3",
        RDZV_TIMEOUT="60",
    )
    return user_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RECORD=str(record), **{**slurm, **extra})


def test_sbatch_gives_each_node_its_rank_and_the_first_node_as_master(tmp_path):
    port = free_port()
    env = fake_slurm(tmp_path, MASTER_PORT=str(port))
    del env["GLOO_SOCKET_IFNAME"]  # the launcher chooses it
    run(["bash", str(REPO / "launch_slurm.sbatch"), "ddp", "--epochs", "1"], env=env, timeout=120)
    record, python = tmp_path / "record", shutil.which("python", path=env["PATH"])
    srun_args = (record / "srun.args").read_text().split()
    assert srun_args[:3] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    for node in (0, 1):
        got = json.loads((record / f"torchrun.{node}.json").read_text())
        assert got["args"] == [
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--rdzv-conf",
            "timeout=60",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "0",
            "--no-python",  # each rank under tools/worker.py, which ties it to torchrun and reports how it ended
            python,
            str(REPO / "tools" / "worker.py"),
            python,
            "-u",
            "-m",
            "recipes",
            "run",
            "ddp",
            "--epochs",
            "1",
        ], (record / f"node{node}.out").read_text()
        assert got["env"]["MASTER_ADDR"] == "node01"  # as SLURM named it; the launcher resolved it for torchrun
        assert got["env"]["GLOO_SOCKET_IFNAME"] == got["env"]["NCCL_SOCKET_IFNAME"] == "lo"


def test_sbatch_port_comes_from_the_job_id(tmp_path):
    port = next(p for p in iter(free_port, None) if 20000 <= p < 40000)  # a job id that maps onto a free port
    env = fake_slurm(tmp_path, NNODES="1", SLURM_JOB_ID=str(port - 20000))  # one node: nothing waits on the port
    run(["bash", str(REPO / "launch_slurm.sbatch"), "ddp", "--epochs", "1"], env=env, timeout=120)
    got = json.loads((tmp_path / "record" / "torchrun.0.json").read_text())
    assert got["env"]["MASTER_PORT"] == str(port)


def test_sbatch_outside_slurm_says_so():
    proc = run(["bash", str(REPO / "launch_slurm.sbatch"), "ddp"], env=user_env(), check=False, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: not inside a SLURM job: submit with sbatch launch_slurm.sbatch NAME [options]"


@pytest.mark.parametrize("missing", ["srun", "scontrol"])
def test_sbatch_in_a_job_without_slurms_commands_says_so(tmp_path, missing):
    """SLURM's variables set but its commands not on PATH (not a SLURM node, or its bin/ not on PATH): one line."""
    env = fake_slurm(tmp_path)
    (tmp_path / "bin" / missing).unlink()
    proc = run(["bash", str(REPO / "launch_slurm.sbatch"), "ddp"], env=env, check=False, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {missing} is not on PATH: this is not a SLURM node (or SLURM's bin/ is missing from PATH); "
        "submit with sbatch launch_slurm.sbatch NAME [options]"
    )
    assert not (tmp_path / "record" / "srun.args").exists()
