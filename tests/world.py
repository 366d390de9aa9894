"""A gloo world that lives for a whole test module: start it once, run many checks on it.

    @pytest.fixture(scope="module")
    def world2():
        with GlooWorld(2) as world:
            yield world

    def check_sum(topo, x):          # module level, so the workers can import it
        return reduce_sum(torch.tensor(x)).item()

    def test_sum(world2):
        assert world2.run(check_sum, 3.0) == [6.0, 6.0]   # one result per rank

Each worker joins the group through a FileStore in a temporary folder (no port to collide),
with GLOO_SOCKET_IFNAME=lo and a short timeout, and destroys it when the world closes.
A check that raises on any rank fails the test with that rank's traceback; one that hangs
fails it after `timeout_s`, and the world is torn down rather than left hanging.
"""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, sys_path: list[str], env: dict, tasks, results, timeout_s):
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(env, GLOO_SOCKET_IFNAME="lo")  # the test's environment now, not the fork server's at its start
    import torch
    import torch.distributed as dist

    from core.kernel.train import Topology

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    topo = Topology(rank, world_size, torch.device("cpu"))
    try:
        while (task := tasks.get()) is not None:
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(topo, *args, **kwargs)))
            except BaseException:  # report, keep serving: the next check gets a working world
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    # Every result has been read (close() asks to stop only then): end here, past the interpreter's teardown,
    # which with gloo's threads still alive can take seconds (or abort; see tools/options.py's leave).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class GlooWorld:
    """`world_size` CPU processes in one gloo group; `run(fn, ...)` calls fn(topo, ...) on each."""

    def __init__(self, world_size: int, *, timeout_s: float = 60.0):
        self.world_size = world_size
        self.timeout_s = timeout_s

    def __enter__(self) -> GlooWorld:
        # Each rank is forked from a server that imported torch once for this pytest process (a fresh interpreter
        # would import it again, about a second of CPU a rank); the server itself runs nothing, so no thread or
        # state of a test's is copied into a rank.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "core.kernel.train"])  # before its first start
        self._tmp = tempfile.TemporaryDirectory()
        store_path = os.path.join(self._tmp.name, "store")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        # One OpenMP thread a rank, as torchrun sets for its workers: torch.set_num_threads alone leaves LAPACK's
        # threads free, and under load they split a QR differently on each rank (PowerSGD's replicas then drift).
        # The fork server, started by the first start() here, loads those libraries with it set; each rank gets
        # the environment as it is inside this window.
        threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            self._procs = [
                ctx.Process(
                    target=_worker,
                    daemon=True,
                    args=(
                        rank,
                        self.world_size,
                        store_path,
                        list(sys.path),
                        dict(os.environ),
                        self._tasks[rank],
                        self._results,
                        self.timeout_s,
                    ),
                )
                for rank in range(self.world_size)
            ]
            for proc in self._procs:
                proc.start()
        finally:
            if threads is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = threads
        return self

    def run(self, fn, *args, **kwargs) -> list:
        """fn(topo, *args, **kwargs) on every rank; returns the results in rank order."""
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        by_rank, failures = {}, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(
                    f"{fn.__name__} did not finish on every rank within {self.timeout_s}s (finished: {sorted(by_rank)})"
                ) from None
            by_rank[rank] = value
            if not ok:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise AssertionError(f"{fn.__name__} failed\n" + "\n".join(failures))
        return [by_rank[r] for r in range(self.world_size)]

    def close(self, *, kill: bool = False) -> None:
        for tasks, proc in zip(self._tasks, self._procs):
            if proc.is_alive() and not kill:
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._tmp.cleanup()

    def __exit__(self, *exc) -> None:
        self.close()
