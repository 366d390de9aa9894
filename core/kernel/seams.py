"""The seams: plain tables a plug-in appends to when it is imported (or joined into a copy); the kernel reads them.
A plug-in never redefines or patches a kernel name. In a lean copy every table is empty."""

# SEAMS[name]: the hooks a plug-in attached there, called in that order (docs/layout.md: what each is given).
SEAMS: dict[str, list] = {
    name: []
    for name in "option_groups loss_choices after_build trains_on on_open before_job resume_checks read_checks writers "
    "on_resume on_step log_fields pauses after_job on_fail log_sinks streams loss_checks".split()
}
FACTORIES: dict = {}  # "model", "data": fn(cfg) that builds it in place of the built-in one (--model, --data)
CHECKSUMS: dict = {}  # a checksum's prefix -> fn(tensor) that computes it: readers of older formats


def fire(seam: str, *args, **kwargs) -> None:
    """Call every hook of SEAMS[seam] with these arguments, in the order they were attached."""
    for hook in SEAMS[seam]:
        hook(*args, **kwargs)
