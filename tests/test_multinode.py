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
few and short (6 steps), and what waits runs beside what works: one run covers both a slow and a
normal link, while the single-node references train; a node killed, a cable cut and an elastic
restart run side by side, each on hosts of its own (the cut job waits out --timeout-s meanwhile);
so do the three start-ups that must fail.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
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
    single-node launcher; each world size is trained once per module. Both start at once, in the background, when
    the first test asks: they train while that test's two hosts wait on their slow link."""
    started = {}
    for nproc in (4, 2):
        out, logs = tmp_path_factory.mktemp(f"reference{nproc}"), tmp_path_factory.mktemp(f"reference{nproc}-logs")
        with open(logs / "stdout", "w") as stdout, open(logs / "stderr", "w") as stderr:
            proc = subprocess.Popen(
                [str(REPO / "launch_single_node.sh"), "ddp", *OPTS, "--out", str(out)],
                cwd=REPO, env=user_env(NPROC_PER_NODE=str(nproc)), stdout=stdout, stderr=stderr,
            )  # fmt: skip
        started[nproc] = (proc, out, logs)
    done: dict[int, dict[str, torch.Tensor]] = {}

    def reference(nproc: int) -> dict[str, torch.Tensor]:
        if nproc not in done:
            proc, out, logs = started[nproc]
            try:
                code = proc.wait(timeout=BOUND_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            assert code == 0, (logs / "stderr").read_text()[-3000:]
            done[nproc] = weights_of(out)
        return done[nproc]

    yield reference
    for proc, _, _ in started.values():  # a test that failed before it asked: not left running
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def net():
    with netns.TwoHosts() as two_hosts:
        yield two_hosts


@needs_netns
def test_two_hosts_train_like_one_node_on_a_slow_then_normal_link(net, single_node, tmp_path):
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
    assert_same_weights(weights_of(tmp_path / "runs"), single_node(4))  # 2 nodes x 2 processes


def _killed_or_cut(net: netns.TwoHosts, other: netns.TwoHosts, tmp_path: Path) -> None:
    """Two jobs side by side, one on each pair of hosts: in one a node dies, in the other the cable is cut."""
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


@pytest.fixture(scope="module")
def long_faults(tmp_path_factory) -> dict[str, Future]:
    """The long fault scenarios side by side, each in a thread on hosts of its own, so that the cut job's wait for
    --timeout-s overlaps the elastic job's restart: {scenario: its future, whose result() raises what failed}."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        net, other, elastic = (stack.enter_context(netns.TwoHosts()) for _ in range(3))  # made here: unique names
        return {
            "killed or cut": pool.submit(_killed_or_cut, net, other, tmp_path_factory.mktemp("killed")),
            "elastic": pool.submit(_elastic, elastic, tmp_path_factory.mktemp("elastic")),
        }  # the pool's end waits for both, then the hosts go


@needs_netns
def test_node_killed_or_link_cut_every_node_exits_saying_why(long_faults):
    long_faults["killed or cut"].result()


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The start-ups that must fail, side by side, each on two hosts of its own (their waits overlap): {case:
    (its nodes, each one's exit status, MASTER_ADDR)}. nproc differs: node 0 with 2 processes, node 1 with 1;
    unreachable: node 1 alone, node 0's cable out (SYNs to it go unanswered); port in use: node 0 alone, something
    else listening on MASTER_PORT."""
    tmp = tmp_path_factory.mktemp("refused")
    with contextlib.ExitStack() as stack:
        differs, unreachable, in_use = (stack.enter_context(netns.TwoHosts()) for _ in range(3))
        master = differs.hosts[0].addr
        started = {
            "nproc differs": [
                Node(
                    differs,
                    host,
                    ["ddp", *OPTS, "--out", str(tmp / "differs" / "runs")],
                    node_env(master, NODE_RANK=str(rank), NPROC_PER_NODE=str(2 - rank)),
                    tmp / "differs" / host.name,
                )
                for rank, host in enumerate(differs.hosts)
            ]
        }
        a, b = unreachable.hosts
        unreachable.link_down(a)
        env = node_env(a.addr, NODE_RANK="1", RDZV_TIMEOUT="4")
        started["unreachable"] = [Node(unreachable, b, ["ddp", *OPTS], env, tmp / "unreachable")]
        a, _ = in_use.hosts
        squat = "import socket, time; s = socket.create_server(('', 29500)); print('up', flush=True); time.sleep(60)"
        squatter = in_use.popen(a, ["python", "-c", squat])
        assert squatter.stdout.readline().strip() == "up"
        started["port in use"] = [Node(in_use, a, ["ddp", *OPTS], node_env(a.addr, NODE_RANK="0"), tmp / "in_use")]
        masters = {"nproc differs": master, "unreachable": unreachable.hosts[0].addr, "port in use": a.addr}
        return {case: (nodes, [node.wait() for node in nodes], masters[case]) for case, nodes in started.items()}


@needs_netns
def test_nproc_per_node_differs(refused):
    nodes, codes, _ = refused["nproc differs"]
    for node, code in zip(nodes, codes, strict=True):
        assert code != 0
        assert "NPROC_PER_NODE differs between nodes" in node.last_error, node.stderr[-3000:]


@needs_netns
def test_master_unreachable(refused):
    (node1,), (code,), master = refused["unreachable"]
    assert code == 2
    assert node1.last_error.startswith(f"error: cannot reach MASTER_ADDR:MASTER_PORT {master}:29500")


@needs_netns
def test_master_port_in_use(refused):
    (node0,), (code,), _ = refused["port in use"]
    assert code == 2
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


def _elastic(net: netns.TwoHosts, tmp_path: Path) -> Path:
    """A node killed and started again: the run folder of the job it rejoined, which went on from a checkpoint."""
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
    return tmp_path / "runs"


@needs_netns
def test_elastic_restarted_node_resumes_from_checkpoint(long_faults, single_node):
    assert_same_weights(weights_of(long_faults["elastic"].result()), single_node(2))
