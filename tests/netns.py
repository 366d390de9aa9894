"""Two hosts on one machine: two Linux network namespaces joined by a veth pair.

    with TwoHosts() as net:                       # root only; see `unavailable()`
        a, b = net.hosts                          # a.addr 10.213.N.1, b.addr 10.213.N.2
        proc = net.popen(a, ["./launch_multi_node.sh", "ddp"], env=env)
        net.link_down(b)                          # cut the cable on b's side
        net.shape(a, rate="50mbit")               # a slow link (tbf; this kernel has no netem)

The addresses exist only inside the two namespaces (a private 10.213.0.0/16 test range), so
nothing a test starts can reach any other address. Each namespace has only `lo` and its veth
end: no route out. Every process started through `popen` runs in its own session, and on exit
(also when the test fails or is interrupted) those sessions are killed, then the namespaces
are deleted, which deletes both veth ends with them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    name: str  # the namespace's name
    ifname: str  # its end of the veth pair
    addr: str  # its address on that end


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str | None:
    """Why two namespaces can't be made here (None when they can): for pytest.skip."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root and runs this)"
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    probe = f"tdrprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


class TwoHosts:
    """Context manager: namespaces `tdr<pid><n>a`/`...b`, veth ends with 10.213.<n>.1/.2 on a /24."""

    _count = 0

    def __init__(self):
        TwoHosts._count += 1
        tag = f"{os.getpid() % 100000}{TwoHosts._count % 10}"  # unique per test process and use
        subnet = f"10.213.{(os.getpid() + TwoHosts._count) % 250}"
        self.hosts = (Host(f"tdr{tag}a", f"tdr{tag}a", f"{subnet}.1"), Host(f"tdr{tag}b", f"tdr{tag}b", f"{subnet}.2"))
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> TwoHosts:
        a, b = self.hosts
        try:
            for host in self.hosts:
                _ip("netns", "add", host.name)
            _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
            for host in self.hosts:
                _ip("link", "set", host.ifname, "netns", host.name)
                _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
                _ip("-n", host.name, "link", "set", host.ifname, "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill what we started, then delete the namespaces (and so both veth ends)."""
        for host in self.hosts:
            self.kill_host(host)
        for proc in self._procs:
            self.kill(proc)
        for host in self.hosts:
            _ip("netns", "del", host.name, check=False)
        a, _ = self.hosts
        _ip("link", "del", a.ifname, check=False)  # only there if the move into a namespace failed

    # Running things on a host.
    def cmd(self, host: Host, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.name, *args]

    def popen(self, host: Host, args: list[str], **kwargs) -> subprocess.Popen:
        """Start `args` inside `host`, in a new session, so `kill` takes its whole process tree."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(self.cmd(host, args), start_new_session=True, text=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: Host, args: list[str], *, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(host, args), capture_output=True, text=True, timeout=timeout)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL a process started by `popen` and everything in its session: a node dying."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group id is its pid
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process inside `host` (all started by us: nothing else runs in it).

        torchrun puts each worker in a session of its own, so killing the launcher's session
        is not enough to take a whole node down.
        """
        pids = _ip("netns", "pids", host.name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    # The link.
    def link_down(self, host: Host) -> None:
        _ip("-n", host.name, "link", "set", host.ifname, "down")

    def link_up(self, host: Host) -> None:
        _ip("-n", host.name, "link", "set", host.ifname, "up")

    def shape(self, host: Host, *, rate: str = "50mbit", burst: str = "256kb", latency: str = "400ms") -> None:
        """Limit what `host` sends to `rate` (token bucket); shape both hosts for a symmetric link."""
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                host.name,
                "tc",
                "qdisc",
                "replace",
                "dev",
                host.ifname,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                latency,
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )

    def unshape(self, host: Host) -> None:
        subprocess.run(
            ["ip", "netns", "exec", host.name, "tc", "qdisc", "del", "dev", host.ifname, "root"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
