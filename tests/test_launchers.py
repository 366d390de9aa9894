"""The launchers under bad input and faults: one `error:` line each, no orphans, nothing listening beyond loopback.

The end-to-end tests start real torchrun jobs of the ddp recipe on a tiny model (2 CPU processes). Times are
bounds for "did not hang", never asserted as speeds.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch import nn

from core.dist import free_port
from helpers import REPO, run, torchrun, user_env

SINGLE, MULTI = str(REPO / "launch_single_node.sh"), str(REPO / "launch_multi_node.sh")
BOUND_S = 30  # a worker still alive this long after its launcher died is an orphan


class FailsOnRank1(nn.Module):
    """tests/tiny.py's MLP, except that rank 1 raises (or hangs) at its third step: a rank that simply fails."""

    def __init__(self, how: str):
        super().__init__()
        from core.models import MLP

        self.inner, self.how, self.calls = MLP(hidden=32, depth=2), how, 0

    def forward(self, x):
        self.calls += self.training
        if os.environ.get("RANK") == "1" and self.calls == 3:
            if self.how == "hang":
                time.sleep(3600)
            raise ValueError("rank 1 fails on purpose")
        return self.inner(x)


def raises() -> nn.Module:
    return FailsOnRank1("raise")


def hangs() -> nn.Module:
    return FailsOnRank1("hang")


def env(**extra: str) -> dict[str, str]:
    tests = str(Path(__file__).parent)
    return user_env(PYTHONPATH=os.pathsep.join([str(REPO), tests]), **extra)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# --- item 11.6: the single-node launcher checks its environment, one line each -------------------------


@pytest.mark.fast
@pytest.mark.parametrize(
    "name, value, fix",
    [
        ("NPROC_PER_NODE", "0", "1 or more"),
        ("NPROC_PER_NODE", "abc", "1 or more"),
        ("NPROC_PER_NODE", "-1", "1 or more"),
        ("MASTER_PORT", "99999", "1..65535"),
        ("MASTER_PORT", "abc", "1..65535"),
        ("MASTER_PORT", "0", "1..65535"),
        ("MAX_RESTARTS", "abc", "0 or more"),
    ],
)
def test_single_node_bad_environment_one_line(name, value, fix):
    proc = run([SINGLE, "--max-steps", "2"], env=env(**{name: value}), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {name}={value}: use ") and fix in line


@pytest.mark.fast
def test_multi_node_options_alone_mean_ddp():
    """`launch_multi_node.sh --max-steps 2` is ddp (its dry-run passes), so the next check speaks: NPROC_PER_NODE."""
    proc = run([MULTI, "--max-steps", "2"], env=env(NPROC_PER_NODE="0"), check=False, timeout=120)
    assert error_lines(proc.stderr) == ["error: NPROC_PER_NODE=0: use 1 or more processes"], proc.stderr[-2000:]


# --- items 11.6 and 11.11: a rank that raises or hangs ends with one line that says so -------------------

TINY = ["--epochs", "1", "--max-steps", "20", "--batch-size", "8", "--log-every", "1"]


@pytest.mark.e2e
@pytest.mark.parametrize("launcher", ["single", "multi"])
def test_a_rank_raises_one_line_names_the_exception(tmp_path, launcher):
    extra = {"NNODES": "1", "MASTER_PORT": str(free_port())} if launcher == "multi" else {}
    args = [SINGLE if launcher == "single" else MULTI, "ddp", *TINY, "--model", "test_launchers:raises"]
    proc = run([*args, "--out", str(tmp_path)], env=env(NPROC_PER_NODE="2", **extra), check=False, timeout=240)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "ValueError: rank 1 fails on purpose" in last, proc.stderr[-3000:]
    assert "lost the connection" not in last


@pytest.mark.e2e
def test_a_rank_hangs_one_line_says_a_collective_timed_out(tmp_path):
    args = [SINGLE, "ddp", *TINY, "--model", "test_launchers:hangs", "--timeout-s", "10", "--out", str(tmp_path)]
    proc = run(args, env=env(NPROC_PER_NODE="2"), check=False, timeout=240)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ddp failed") and "timed out" in last.lower(), proc.stderr[-3000:]


# --- items 11.3 and 11.10: no orphans after kill -9, and a single-node job listens on loopback only ------


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def listening(pids: list[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket these processes listen on, from /proc/net/tcp{,6}."""
    inodes = set()
    for pid in pids:
        for fd in (Path("/proc") / str(pid) / "fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-endian
                found.append((ipaddress.ip_address(raw), int(hexport, 16)))
    return found


def is_loopback(addr) -> bool:
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def start_and_wait_for_workers(cmd: list[str], *, out: Path, agent_of) -> tuple[subprocess.Popen, int, list[int]]:
    """Start a long run; return it once two workers exist and training has begun (config.json written)."""
    log = open(out.parent / "launch.log", "w")
    environ = env(NPROC_PER_NODE="2")
    del environ["GLOO_SOCKET_IFNAME"]  # the launcher must keep gloo on loopback by itself
    proc = subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(240):
        agent = agent_of(proc.pid)
        workers = children(agent) if agent else []
        if len(workers) == 2 and list(out.glob("*/config.json")):
            return proc, agent, workers
        assert proc.poll() is None, (out.parent / "launch.log").read_text()[-3000:]
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the run did not start: " + (out.parent / "launch.log").read_text()[-3000:])


def assert_gone(pids: list[int], out: Path) -> None:
    for _ in range(BOUND_S * 4):
        if not any(alive(pid) for pid in pids):
            break
        time.sleep(0.25)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # do not leave them to the next test
    assert not left, f"workers {left} outlived their launcher"
    assert not list(out.glob("*/model.safetensors"))


LONG = ["ddp", "--model", "tiny:mlp", "--epochs", "1000", "--batch-size", "8", "--log-every", "50"]


@pytest.mark.e2e
def test_kill_9_of_torchrun_ends_its_workers(tmp_path):
    out = tmp_path / "runs"
    cmd = torchrun("-m", "recipes", "run", *LONG, "--out", str(out))
    proc, agent, workers = start_and_wait_for_workers(cmd, out=out, agent_of=lambda pid: pid)
    os.kill(agent, signal.SIGKILL)
    proc.wait(timeout=BOUND_S)
    assert_gone(workers, out)


@pytest.mark.e2e
def test_single_node_listens_on_loopback_only_and_dies_with_its_launcher(tmp_path):
    out = tmp_path / "runs"

    def agent_of(launcher: int) -> int | None:
        found = [pid for pid in children(launcher) if b"torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        return found[0] if found else None

    proc, agent, workers = start_and_wait_for_workers([SINGLE, *LONG, "--out", str(out)], out=out, agent_of=agent_of)
    sockets = listening([agent, *workers])
    assert sockets and all(is_loopback(addr) for addr, _ in sockets), sockets
    os.kill(proc.pid, signal.SIGKILL)  # the launcher itself: torchrun follows it, and the workers follow torchrun
    proc.wait(timeout=BOUND_S)
    assert_gone([agent, *workers], out)


@pytest.mark.fast
@pytest.mark.parametrize(
    "line", ["Timed out waiting 20000ms for recv operation to complete", "Application timeout caused pair closure"]
)
def test_a_collective_timeout_is_named_in_either_of_gloos_words(tmp_path, line):
    """gloo says a silent peer's timeout two ways; both are the launcher's "a collective timed out" (the multi-node
    launcher turns it into "the peer is unreachable"), not "rank 0 exited with code 1"."""
    log = tmp_path / "log"
    log.write_text(f"[rank0]: RuntimeError: {line}\nRoot Cause\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1\n")
    script = f"source {REPO / 'launch_common.sh'} >/dev/null 2>&1; failure_cause {log}"
    cause = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30).stdout
    assert cause.startswith("a collective timed out (") and line[:24] in cause, cause


@pytest.mark.fast
@pytest.mark.parametrize(
    "closed", ["Connection closed by peer [10.0.0.2]:41234", "[10.0.0.2]:41234: Connection reset by peer"]
)
def test_a_connection_closed_by_a_rank_of_this_node_is_not_the_lost_peer(tmp_path, closed):
    """The cut node's rank 2 times out and exits; rank 3, beside it, then loses its connection to rank 2. On that
    node (10.0.0.2) the cause is the timeout: the peer is unreachable. On the other node the same line names a
    lost peer, 10.0.0.2."""
    log = tmp_path / "log"
    log.write_text(
        f"[rank3]: RuntimeError: {closed}\n"
        "[rank2]: RuntimeError: Timed out waiting 20000ms for recv operation to complete\n"
    )

    def cause(this_node: str) -> str:
        script = f"source {REPO / 'launch_common.sh'} >/dev/null 2>&1; failure_cause {log} {this_node}"
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30).stdout

    assert cause("10.0.0.2").startswith("a collective timed out (Timed out waiting 20000ms"), cause("10.0.0.2")
    assert cause("10.0.0.1").startswith("lost the connection to peer 10.0.0.2 ("), cause("10.0.0.1")
