"""Several training runs in one torchrun launch: standalone copies first, then the packaged recipes.

    torchrun --standalone --nproc-per-node 2 tests/copy_jobs.py JOBS.json

JOBS.json is a list of {"label", "copy": PATH} or {"label", "recipe": NAME}, each with "args". Every rank runs
the jobs in order, in one process group made once (a run's init_pg finds it joined and its cleanup leaves it
for the next run), so the launch and the imports are paid once for many runs. While the copies run, importing
`core` or `recipes` raises: a copy that still needs the package fails loudly. Each job ends with a line
`job LABEL exit CODE` on stdout.
"""

import importlib.abc
import json
import os
import runpy
import sys

import torch.distributed as dist


class _Exit(BaseException):  # a run's os._exit(code), caught here: the next job goes on
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("core", "recipes"):
            raise ImportError(f"a standalone copy imported {name!r} from torch-dist-recipes")
        return None


def _exit(code: int = 0):
    raise _Exit(code)


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo")  # shared by every job: their init_pg joins it
    destroy, leave = dist.destroy_process_group, os._exit
    os._exit, dist.destroy_process_group = _exit, lambda *a, **k: None
    blocked = _Blocked()
    sys.meta_path.insert(0, blocked)
    for job in jobs:
        if "recipe" in job and blocked in sys.meta_path:
            sys.meta_path.remove(blocked)
        sys.argv = [job.get("copy", "recipes"), *(["run", job["recipe"]] if "recipe" in job else []), *job["args"]]
        code = 0
        try:
            if "copy" in job:
                runpy.run_path(job["copy"], run_name="__main__")
            else:
                from tools.cli import main as package

                package()
        except _Exit as done:
            code = done.code
        except SystemExit as done:
            code = done.code or 0
        print(f"job {job['label']} exit {code} rank {rank}", flush=True)
    dist.barrier()
    destroy()
    sys.stdout.flush()
    leave(0)  # past the interpreter's teardown, as core.config.leave does (gloo's threads, pytorch/pytorch#179291)


if __name__ == "__main__":
    main()
