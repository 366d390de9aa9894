"""The seams: plain tables a plug-in appends to when it is imported (or joined into a copy); the kernel reads them.
A plug-in never redefines or patches a kernel name. In a lean copy every table is empty."""

OPTION_GROUPS: list[type] = []  # option groups (frozen dataclasses) a recipe's Config takes before its own
FACTORIES: dict = {}  # "model", "data": fn(cfg) that builds it in place of the built-in one (--model, --data)
LOSS_CHOICES: list = []  # fn(cfg, model, loss) -> the Loss the run takes in place of `loss` (--loss)
AFTER_BUILD: list = []  # fn(cfg, model): the plain model, built, before DDP wraps it (--init-from)
TRAINS_ON: list = []  # fn(cfg, run_dir, resume) -> True: a finished run that --resume continues trains on
ON_OPEN: list = []  # fn(path, config, new): rank 0 chose the run folder, before it writes there (lock, config.json)
BEFORE_JOB: list = []  # fn(cfg, run): every rank, once the run folder is open
RESUME_CHECKS: list = []  # fn(path, meta, config) -> options a resume may change; raises when it cannot (checks)
READ_CHECKS: list = []  # fn(path, tensors, model): a checkpoint read back whole (model None: not loading it yet)
CHECKSUMS: dict = {}  # a checksum's prefix -> fn(tensor) that computes it: readers of older formats
WRITERS: list = []  # fn(file, tensors, metadata): writes a safetensors file with its checksums (the last one wins)
ON_RESUME: list = []  # fn(run, scheduler_state, optimizer=, scheduler=, step=): a checkpoint's state is loaded
ON_STEP: list = []  # fn(metrics): after every optimizer step
LOG_FIELDS: list = []  # fn() -> {field: number}: more numbers of a train record (a collective: every rank calls it)
PAUSES: list = []  # a context manager's factory: time that is not training (evaluation, checkpoints)
AFTER_JOB: list = []  # fn(cfg, run, model) -> summary fields or None: after the final weights
ON_FAIL: list = []  # fn(refused): the run ends in an error; refused: one a restart would meet again
LOG_SINKS: list = []  # fn(run, record): rank 0's write_record hands each metrics.jsonl record on (--log-to)
STREAMS: list = []  # fn(cfg, topo, train, val, collate_fn) -> (train loader, val loader, steps) for a stream, else None
# (core/amp.py's make_loaders; the stream plug-in)
LOSS_CHECKS: list = []  # fn(logits, targets): one line where they do not line up (core/schedules.py's TokenLoss asks)
