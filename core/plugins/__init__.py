"""The plug-ins: one file per feature a lean copy leaves out, each attached at the kernel's seams (core/kernel/seams.py)
when it is imported. core/attach.py attaches them all for the package's recipes; `cp NAME DEST --standalone --with
F,...` joins the files named. The registry lists them (tools/registry.py, PLUGINS)."""
