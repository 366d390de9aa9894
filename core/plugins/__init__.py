"""The plug-ins: one file per feature a lean copy leaves out, each attached at the kernel's seams (core/kernel/seams.py)
when it is imported. The package's recipes import this package, so they run with every plug-in; `cp NAME DEST
--standalone --with F,...` joins the files named. The registry lists them (tools/registry.py, PLUGINS)."""

from core.plugins import (  # noqa: F401 - the order they attach in, and so the summary's order
    checks,
    factories,
    fast_writer,
    hf,
    init_from,
    lock,
    loss,
    meter,
    old_checksums,
    records,
    replicas,
    take_back,
)

factories.MODELS.update(cnn="core.models:cnn", gpt="core.gpt:gpt")  # the package's other built-ins
factories.DATASETS.update(digits="core.datasets:digits", synthetic="core.datasets:synthetic", text="core.gpt:text")
