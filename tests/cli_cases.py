"""Several `python -m recipes ARGS` or `python FILE ARGS` in one interpreter: each one's exit status and output.

    python tests/cli_cases.py CASES.json      # [{"args": [...], "cwd": FOLDER, "file": PATH, "env": {...}}, ...]

prints a JSON list of {"code", "stdout", "stderr"}, one per case, in order. Each case runs recipes/__main__.py as
`python -m recipes` does, or FILE as `python FILE` does (runpy, as __main__), in its own working folder, with its
"env" (variables set for that case alone), its file
descriptors 1 and 2 on files of its own (so that every writer lands there: print, click, the run's logger); the
os._exit that ends a command (tools/options.py's leave) ends the case instead, with its status. The interpreter and its
imports are paid once for all the cases, not once each: for commands that end before any process group (bad input,
--help) or that make and end their own (a recipe run as a file, on one process).
"""

import json
import os
import runpy
import sys
import tempfile
import traceback

from copy_jobs import _Exit, _exit  # a command's os._exit(code) raises _Exit: the next case goes on


def run_case(args: list[str], cwd: str, file: str | None = None, env: dict | None = None) -> dict:
    saved, here = (os.dup(1), os.dup(2)), os.getcwd()
    before = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.chdir(cwd)
        sys.argv = [file or "recipes", *args]
        code = 0
        try:
            if file:
                runpy.run_path(file, run_name="__main__")
            else:
                runpy.run_module("recipes", run_name="__main__", alter_sys=True)
        except _Exit as done:
            code = done.code
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        except Exception:  # as an uncaught exception ends `python -m recipes`: its traceback, status 1
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.chdir(here)
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
        said = {}
        for name, file in (("stdout", out), ("stderr", err)):
            file.seek(0)
            said[name] = file.read().decode(errors="replace")
        return {"code": code, **said}


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    leave, os._exit = os._exit, _exit
    results = [run_case(case["args"], case["cwd"], case.get("file"), case.get("env")) for case in cases]
    sys.stdout.write(json.dumps(results))
    sys.stdout.flush()
    leave(0)  # past the interpreter's teardown, as tools.options.leave does


if __name__ == "__main__":
    main()
