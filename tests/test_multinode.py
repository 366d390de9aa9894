"""launch_multi_node.sh across two real network hosts: two namespaces joined by a veth pair.

Each "node" is a network namespace with its own address (10.213.N.1 and .2) and no route
anywhere else; both see the same files, like nodes on a shared file system. The hostname
means 127.0.0.1 in both, which is exactly the set-up where gloo, left to itself, advertises
loopback and the job dies: so GLOO_SOCKET_IFNAME is NOT set here, and the launcher has to
find the veth interface itself. The namespaces are private, so the fixed MASTER_PORT inside
them can collide with nothing.

Stated bounds (never asserted as times, only as "did not hang"): a lost or unreachable peer
ends every node within --timeout-s (20 s here) plus torchrun's shut-down, well inside BOUND_S.

Cost: every training run starts 2 launchers, 2 torchrun agents and their workers, so runs are
few and short (6 steps): one run covers both a slow and a normal link, and the two fault
scenarios share one test, run side by side (one waits out --timeout-s while the other finishes).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import netns
import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, run, user_env

_why_not = netns.unavailable()
needs_netns = pytest.mark.skipif(_why_not is not None, reason=f"two-host test skipped: {_why_not}")

LAUNCHER = str(REPO / "launch_multi_node.sh")
TIMEOUT_S = 20  # the recipe's --timeout-s: how long a collective waits for a silent peer
BOUND_S = 120  # a node that has not exited this long after a fault is hung
OPTS = ["--epochs", "1", "--max-steps", "6", "--batch-size", "8", "--log-every", "1", "--timeout-s", str(TIMEOUT_S)]
LONG = ["--epochs", "50", "--max-steps", "2000", "--batch-size", "8", "--log-every", "1", "--timeout-s", str(TIMEOUT_S)]


def node_env(master: str, **extra: str) -> dict[str, str]:
    env = user_env(NNODES="2", NPROC_PER_NODE="2", MASTER_ADDR=master, MASTER_PORT="29500", RDZV_TIMEOUT="60")
    del env["GLOO_SOCKET_IFNAME"]  # the launcher must find the interface by itself
    env.update(extra)
    return env


class Node:
    """One launcher in one namespace, its output in files (pipes could fill and block it)."""

    def __init__(self, net: netns.TwoHosts, host: netns.Host, args: list[str], env: dict, logs: Path):
        self.host, self.logs = host, logs
        logs.mkdir(parents=True, exist_ok=True)
        self._out, self._err = open(logs / "stdout", "w"), open(logs / "stderr", "w")
        self.proc = net.popen(host, [LAUNCHER, *args], env=env, cwd=REPO, stdout=self._out, stderr=self._err)

    def wait(self, timeout: float = BOUND_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {self.host.addr} still running {timeout}s on (hung)\n{self.stderr[-3000:]}")
        finally:
            self._out.close()
            self._err.close()

    @property
    def stderr(self) -> str:
        return (self.logs / "stderr").read_text(errors="replace")

    @property
    def last_error(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.startswith("error: ")]
        return lines[-1] if lines else ""

    @property
    def output(self) -> str:  # progress lines go to stdout, the launcher's and torchrun's to stderr
        return (self.logs / "stdout").read_text(errors="replace") + self.stderr

    def wait_for(self, text: str, *, timeout: float = BOUND_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"node {self.host.addr} never printed {text!r}\n{self.stderr[-3000:]}")
            time.sleep(0.2)


def start_pair(net, folder: Path, recipe_args, **extra_env) -> tuple[Node, Node]:
    """Node 0 and node 1 of one job: run folder `folder/runs`, logs in `folder/<namespace>`."""
    a, b = net.hosts
    nodes = []
    for rank, host in enumerate(net.hosts):
        env = node_env(a.addr, NODE_RANK=str(rank), **extra_env)
        nodes.append(Node(net, host, ["ddp", *recipe_args, "--out", str(folder / "runs")], env, folder / host.name))
    return nodes[0], nodes[1]


def weights_of(out: Path) -> dict[str, torch.Tensor]:
    (path,) = out.glob("*/model.safetensors")  # exactly one run: a restarted job resumes into it
    return load_file(path)


def assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        # The same 4 ranks, the same gloo allreduce, the same data shares: bit for bit.
        assert torch.equal(got[key], want[key]), key


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    """reference(nproc): the same training as `nproc` processes on one node (loopback), through the
    single-node launcher; each world size is trained once per module."""
    done: dict[int, dict[str, torch.Tensor]] = {}

    def reference(nproc: int) -> dict[str, torch.Tensor]:
        if nproc not in done:
            out = tmp_path_factory.mktemp(f"reference{nproc}")
            run(
                [str(REPO / "launch_single_node.sh"), "ddp", *OPTS, "--out", str(out)],
                env=user_env(NPROC_PER_NODE=str(nproc)),
                timeout=BOUND_S,
            )
            done[nproc] = weights_of(out)
        return done[nproc]

    return reference


@pytest.fixture
def reference(single_node) -> dict[str, torch.Tensor]:
    return single_node(4)  # 2 nodes x 2 processes


@pytest.fixture
def net():
    with netns.TwoHosts() as two_hosts:
        yield two_hosts


@needs_netns
def test_two_hosts_train_like_one_node_on_a_slow_then_normal_link(net, reference, tmp_path):
    for host in net.hosts:  # rendezvous and the first steps over a 50 Mbit/s link, the rest at full speed
        net.shape(host, rate="50mbit")
    node0, node1 = start_pair(net, tmp_path, OPTS)
    node0.wait_for("step 2/")
    for host in net.hosts:
        net.unshape(host)
    assert node0.wait() == 0, node0.stderr[-3000:]
    assert node1.wait() == 0, node1.stderr[-3000:]
    for node in (node0, node1):  # each found its veth end, not loopback
        assert f"talking over {node.host.ifname} ({node.host.addr})" in node.stderr
    summary = json.loads((tmp_path / "runs").glob("*/metrics.jsonl").__next__().read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["world_size"] == 4
    assert summary["replicas_identical"], "node 1's ranks hold bit-for-bit the weights rank 0 wrote"
    # Rank 0 (node 0) wrote the weights; every rank compared a digest of its own (summary above).
    assert_same_weights(weights_of(tmp_path / "runs"), reference)


@needs_netns
def test_node_killed_or_link_cut_every_node_exits_saying_why(net, tmp_path):
    # Two jobs side by side, one on each pair of hosts: in one a node dies, in the other the cable is cut.
    with netns.TwoHosts() as other:
        killed = start_pair(net, tmp_path / "killed", LONG)
        cut = start_pair(other, tmp_path / "cut", LONG)
        for node0, _ in (killed, cut):
            node0.wait_for("step 3/")
        net.kill_host(killed[1].host)  # the whole node: launcher, torchrun agent, workers
        other.link_down(cut[1].host)

        survivor = killed[0]  # sees a reset connection at once
        assert survivor.wait() != 0
        assert "lost the connection to peer" in survivor.last_error
        assert killed[1].host.addr in survivor.last_error, survivor.stderr[-3000:]

        for node in cut:  # hear nothing until --timeout-s has passed
            assert node.wait() != 0
            assert "unreachable" in node.last_error, node.stderr[-3000:]
        assert f"node 0 at {cut[0].host.addr}" in cut[1].last_error


@needs_netns
def test_nproc_per_node_differs(net, tmp_path):
    a, b = net.hosts
    nodes = [
        Node(
            net,
            host,
            ["ddp", *OPTS, "--out", str(tmp_path / "runs")],
            node_env(a.addr, NODE_RANK=str(rank), NPROC_PER_NODE=str(2 - rank)),
            tmp_path / host.name,
        )
        for rank, host in enumerate(net.hosts)
    ]
    for node in nodes:
        assert node.wait() != 0
        assert "NPROC_PER_NODE differs between nodes" in node.last_error, node.stderr[-3000:]


@needs_netns
def test_master_unreachable(net, tmp_path):
    a, b = net.hosts
    net.link_down(a)  # node 0's cable is out: SYNs to it go unanswered
    node1 = Node(net, b, ["ddp", *OPTS], node_env(a.addr, NODE_RANK="1", RDZV_TIMEOUT="4"), tmp_path / "b")
    assert node1.wait() == 2
    assert node1.last_error.startswith(f"error: cannot reach MASTER_ADDR:MASTER_PORT {a.addr}:29500")


@needs_netns
def test_master_port_in_use(net, tmp_path):
    a, _ = net.hosts
    squatter = net.popen(
        a,
        [
            "python",
            "-c",
            "import socket, time; s = socket.create_server(('', 29500)); print('up', flush=True); time.sleep(60)",
        ],
    )
    assert squatter.stdout.readline().strip() == "up"
    node0 = Node(net, a, ["ddp", *OPTS], node_env(a.addr, NODE_RANK="0"), tmp_path / "a")
    assert node0.wait() == 2
    assert (
        node0.last_error == "error: MASTER_PORT=29500 is already in use on this node: "
        "pick another port (the same on every node)"
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NODE_RANK": "2"}, "error: NODE_RANK=2 but NNODES=2: node ranks run 0..1"),
        ({"NODE_RANK": "x"}, "error: NODE_RANK=x: use this node's rank, 0..1"),
        (
            {"NNODES": "1:2"},
            "error: NNODES=1:2 is elastic (MIN:MAX): also set RDZV_ID to a job id shared by every node",
        ),
        ({"MASTER_ADDR": ""}, "error: MASTER_ADDR is not set: set it to node 0's address on every node"),
        ({"MASTER_PORT": "70000"}, "error: MASTER_PORT=70000: use a TCP port, 1..65535"),
    ],
)
def test_bad_environment_one_line_before_torchrun(env, message):
    # No namespaces needed: these fail in the launcher before any Python or port.
    proc = run([LAUNCHER, "ddp"], env={**node_env("127.0.0.1"), **env}, check=False, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == message


@needs_netns
def test_elastic_restarted_node_resumes_from_checkpoint(net, single_node, tmp_path):
    # One process per node: a resumed 2-rank job is bit for bit the uninterrupted one. (A resumed 4-rank
    # job, on one node as well, ends about 4e-8 off, float rounding: see docs/multinode.md.)
    for host in net.hosts:  # slow steps, so that the kill lands between two checkpoints
        net.shape(host, rate="50mbit")
    elastic = {"RDZV_ID": "restart-test", "MAX_RESTARTS": "1", "NPROC_PER_NODE": "1"}
    opts = [*OPTS, "--ckpt-every", "2", "--keep", "100", "--resume", "auto"]
    node0, node1 = start_pair(net, tmp_path, opts, **elastic)
    deadline = time.monotonic() + BOUND_S
    while not list((tmp_path / "runs").glob("*/ckpt/*.safetensors")):  # rank 0 saved one
        assert time.monotonic() < deadline and node0.proc.poll() is None, node0.stderr[-3000:]
        time.sleep(0.2)
    net.kill_host(node1.host)
    node1.wait()
    node0.wait_for("failed (exitcode")  # its worker is gone: no checkpoint comes after this
    for host in net.hosts:  # the rest at full speed
        net.unshape(host)
    saved = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "runs").glob("*/ckpt/*.safetensors"))
    # The same command on the same host, started afresh (its TORCHELASTIC_RESTART_COUNT is 0): it
    # joins node 0's second rendezvous round and takes rank 0's decision to resume.
    again = Node(
        net,
        node1.host,
        ["ddp", *opts, "--out", str(tmp_path / "runs")],
        node_env(node0.host.addr, **elastic),
        tmp_path / "restarted",
    )
    assert node0.wait() == 0, node0.stderr[-3000:]
    assert again.wait() == 0, again.stderr[-3000:]
    # Rank 0 is on node 0 (the rendezvous orders nodes by address) and resumed the newest checkpoint.
    (resumed,) = re.findall(r"resumed from \S+/ckpt/step-(\d+)\.safetensors", node0.output)
    assert int(resumed) == saved[-1], saved  # the newest when the group restarted
    summary = json.loads(next((tmp_path / "runs").glob("*/metrics.jsonl")).read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["replicas_identical"], "the restarted node holds bit-for-bit the weights rank 0 wrote"
    assert_same_weights(weights_of(tmp_path / "runs"), single_node(2))
