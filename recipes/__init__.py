"""The recipes: one file each, a whole training story that imports `core` and never another recipe.

The list of recipes is plain data in tools/registry.py; importing this package imports none of them.
"""
