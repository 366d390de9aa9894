"""Several training runs in one torchrun launch: standalone copies first, then the packaged recipes.

    torchrun --standalone --nproc-per-node 2 tests/copy_jobs.py JOBS.json

JOBS.json is a list of {"label", "copy": PATH} or {"label", "recipe": NAME}, each with "args" (and "env", variables
set for that job alone, as the environment of a run of its own: `check`'s runs take one). Every rank runs
the jobs in order, in one process group made once (a run's init_pg finds it joined and its cleanup leaves it
for the next run), so the launch and the imports are paid once for many runs. While the copies run, importing
`core` or `recipes` raises: a copy that still needs the package fails loudly. A copy runs its own parser and
main() with a Config that records which options the run reads (the options walk of tests/test_options.py);
rank 0 prints `unread LABEL [names]`. Each job ends with a line `job LABEL exit CODE rank R` on stdout, after every
rank's lines of that job (a barrier between jobs).
"""

import importlib.abc
import json
import os
import runpy
import sys
import traceback

import torch.distributed as dist


def recording(config):
    """A builder of `config` (a dataclass) whose instance records which fields are read (`_read`); vars(cfg), the
    dump of config.json, reads none, and the checks while it is built do not count. One instance per builder."""
    read, muted = set(), [True]

    class Recording(config):
        _read = read  # a class attribute: vars(cfg) holds the fields alone

        def __getattribute__(self, name):
            if not muted[0]:
                read.add(name)
            return object.__getattribute__(self, name)

    def build(**values):
        cfg = Recording(**values)
        muted[0] = False
        return cfg

    return build


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


def _copy(job: dict) -> None:
    """The copy's cli_main (its parser, its main and its exit) with main() on a recording Config: the walk rides on
    the training run. What it never read goes into job["unread"]."""
    copy = runpy.run_path(job["copy"], run_name="standalone_copy")
    fields = set(copy["Config"].__dataclass_fields__)

    def main(parsed):
        cfg = recording(copy["Config"])(**{f: getattr(parsed, f) for f in fields})
        job["cfg"] = cfg
        copy["main"](cfg)

    sys.argv = [job["copy"], *job["args"]]
    try:
        copy["cli_main"](main, copy["Config"])  # it ends with os._exit: _Exit here
    finally:
        job["unread"] = sorted(fields - job["cfg"]._read) if "cfg" in job else None


def _say(line: str) -> None:
    """A whole line in one write: the ranks print into one pipe, and print() writes a text and its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


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
        code, unread = 0, None
        before = {k: os.environ.get(k) for k in job.get("env", {})}
        os.environ.update(job.get("env", {}))
        try:
            if "copy" in job:
                _copy(job)
            else:
                from tools.cli import main as package

                sys.argv = ["recipes", "run", job["recipe"], *job["args"]]
                package()
        except _Exit as done:
            code = done.code
        except SystemExit as done:
            code = done.code or 0
        except Exception:  # the job's traceback; the next job goes on
            traceback.print_exc()
            code = 1
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
        unread = job.get("unread", unread)
        sys.stdout.flush()
        dist.barrier()  # every rank's lines of this job (a pipeline's last stage prints them) come before its end
        if unread is not None and rank == 0:
            _say(f"unread {job['label']} {unread}")
        _say(f"job {job['label']} exit {code} rank {rank}")
    dist.barrier()
    destroy()
    sys.stdout.flush()
    leave(0)  # past the interpreter's teardown, as tools.options.leave does (gloo's threads, pytorch/pytorch#179291)


if __name__ == "__main__":
    main()
