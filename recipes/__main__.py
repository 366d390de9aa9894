"""python -m recipes: the command line (tools/cli.py)."""

from tools.cli import main

main()
