"""What the hardware can do and what a model costs: peak memory, the device's peak FLOP/s, one sample's FLOPs.

core.monitor reads them when it writes a train record (peak memory, MFU); nothing here is a collective.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Mapping

import torch
from torch.utils.flop_counter import FlopCounterMode

from core.kernel.train import split_outputs


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated tensors on a GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# Dense peak FLOP/s per GPU for the compute dtype, from the vendors' data sheets (no sparsity).
PEAK_TFLOPS = {
    "H200": {"bf16": 989, "fp16": 989, "fp32": 67},
    "H100": {"bf16": 989, "fp16": 989, "fp32": 67},
    "A100": {"bf16": 312, "fp16": 312, "fp32": 19.5},
    "L40S": {"bf16": 362, "fp16": 362, "fp32": 91.6},
    "A10": {"bf16": 125, "fp16": 125, "fp32": 31.2},
    "L4": {"bf16": 121, "fp16": 121, "fp32": 30.3},
    "V100": {"bf16": 0, "fp16": 125, "fp32": 15.7},
    "T4": {"bf16": 0, "fp16": 65, "fp32": 8.1},
}


def peak_flops(device: torch.device, precision: str = "fp32") -> float | None:
    """The device's peak FLOP/s for `precision` (TDR_PEAK_TFLOPS overrides); None on CPU or an unknown GPU."""
    if os.environ.get("TDR_PEAK_TFLOPS"):
        return float(os.environ["TDR_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name and table.get(precision):
            return table[precision] * 1e12
    return None


def flops_per_sample(build: Callable[[], torch.nn.Module], sample) -> float | None:
    """Forward + backward FLOPs of one sample; None if the model can't run on the meta device.

    Counted by torch on a copy of the model built on the meta device (no memory, no compute, no state touched).
    `sample`: one data set item without a batch dim: an input tensor, an (input, ..., target) tuple (the model gets
    all but the target), or a dict of tensors (labels and attention_mask left out: the loss's FLOPs are
    negligible, a mask changes none). A sequence model's count covers the sample's whole length, so FLOPs per
    sequence x sequences/s = FLOPs per token x tokens/s."""
    meta = lambda value: torch.as_tensor(value).to("meta").unsqueeze(0)  # noqa: E731  one sample, a batch of one
    try:
        with torch.device("meta"):
            model = build()
        counter = FlopCounterMode(display=False)
        with counter:
            if isinstance(sample, Mapping):  # transformers reads a mask's values; FLOPs don't
                outputs = model(**{k: meta(v) for k, v in sample.items() if k not in ("labels", "attention_mask")})
            else:
                inputs = sample[:-1] if isinstance(sample, tuple | list) and len(sample) > 1 else [sample]
                outputs = model(*map(meta, inputs))
            split_outputs(outputs)[0].float().sum().backward()
        return float(counter.get_total_flops())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError):  # a model that reads values
        return None
