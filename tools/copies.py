"""What `python -m recipes cp NAME DEST --standalone [--with ...]` writes, and what each copy costs in lines.

`copy_source` is the one place a copy's text is made (the CLI writes it; the tests make every variant with it).
`size_cells` turns measured sizes into the README's two copy columns: the lean copy's lines (code lines), and the
code lines each `--with FEATURE` adds to it (`all`: every feature the recipe has, shared lines counted once).
"""

from __future__ import annotations

from tools.copy_out import copy_size, join
from tools.registry import PLUGINS, RECIPES, plugins_of


def offered(name: str) -> list[str]:
    """What `--with` offers for recipe `name`: its plug-ins."""
    return plugins_of(RECIPES[name])


def feature_options(name: str, feature: str) -> set[str]:
    """The options (Config fields) that `--with feature` adds to recipe `name`'s copy."""
    module = PLUGINS[feature].load()
    groups = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    return {field for group in groups for field in getattr(group, "__dataclass_fields__", {})}


def copy_source(name: str, dest: str, *, kept: set[str]) -> str:
    """The text of recipe `name`'s standalone copy at `dest`, with the plug-ins in `kept` (tools/copy_out.py)."""
    return join(name, dest, kept=[plugin for plugin in offered(name) if plugin in kept])


def size_variants(name: str) -> list[str]:
    """The copies whose sizes the README prints: lean (""), each single feature, and all."""
    features = offered(name)
    return ["", *features, *(["all"] if features else [])]


def size_cells(sizes: dict[str, tuple[int, int]]) -> tuple[str, str]:
    """(lean "lines (code)", "feature +code, ...") from {variant: (lines, code lines)} of one recipe's copies."""
    lines, code = sizes[""]
    added = [f"{variant} +{sizes[variant][1] - code:,}" for variant in sizes if variant]
    return f"{lines:,} ({code:,})", ", ".join(added) or "-"


def breakdown(text: str) -> dict[str, int]:
    """A copy's code lines by where they come from: its header and imports, the recipe, each inlined core module."""
    parts: dict[str, list[str]] = {"header and imports": []}
    part = "header and imports"
    for line in text.splitlines():
        if line.startswith("# from "):  # a joined copy marks each file it joins
            part = line.removeprefix("# from ").split(":")[0]
            part = "the recipe" if part.startswith("recipes/") else part
        parts.setdefault(part, []).append(line)
    return {name: copy_size("\n".join(lines))[1] for name, lines in parts.items()}


def main(argv: list[str] | None = None) -> None:
    """`python -m tools.copies NAME [FEATURE,...]`: where the code lines of a standalone copy come from."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.copies", description=main.__doc__)
    parser.add_argument("name", choices=sorted(RECIPES))
    parser.add_argument("features", nargs="?", default="", help="as cp's --with (all, or names separated by commas)")
    args = parser.parse_args(argv)
    from tools.copy_out import parse_with

    kept = set(parse_with(args.features, recipe=args.name))
    text = copy_source(args.name, "train.py", kept=kept)
    lines, code = copy_size(text)
    print(f"{args.name}'s copy{' with ' + args.features if args.features else ''}: {lines:,} lines, {code:,} code")
    for part, count in sorted(breakdown(text).items(), key=lambda item: -item[1]):
        print(f"{count:6,}  {part}")


if __name__ == "__main__":
    main()
