"""The package's recipes on the kernel run with every plug-in: importing this module attaches them all, each at the
kernel's seams (core/kernel/seams.py). tools/registry.py lists them; a standalone copy joins those `--with` names.
"""

from core.plugins import (  # noqa: F401 - the order they attach in, and so the summary's order
    checks,
    factories,
    fast_writer,
    hf,
    init_from,
    lock,
    longer,
    loss,
    meter,
    old_checksums,
    records,
    replicas,
    take_back,
)

factories.MODELS.update(cnn="core.zoo:cnn", gpt="core.gpt:gpt")  # the package's other built-ins
factories.DATASETS.update(digits="core.zoo:quick_digits", synthetic="core.zoo:synthetic", text="core.gpt:text")
