"""python -m recipes: the command line, reached through the package's console script (torch-dist-recipes), so that
nothing under recipes/ imports tools/."""

import sys
from importlib.metadata import entry_points

found = list(entry_points(group="console_scripts", name="torch-dist-recipes"))
if not found:  # a source tree on PYTHONPATH, never installed: no entry point to read
    sys.exit("error: python -m recipes needs the package installed (it reads its torch-dist-recipes entry point); "
             "run pip install -e . in the repository")  # fmt: skip
found[0].load()()
