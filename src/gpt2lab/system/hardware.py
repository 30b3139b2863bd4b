"""Accelerators' datasheet figures, one table: peak dense bf16/fp16 tensor FLOP/s for MFU.

Names are matched against ``torch.cuda.get_device_name``; the first row whose every fragment
is in the name wins, so the H100 PCIe and NVL (lower clocks and power) are told apart from
the SXM part, whose name ("NVIDIA H100 80GB HBM3") names no form factor.
"""

from __future__ import annotations

from typing import Optional

# (name fragments, peak dense bf16 FLOP/s), most specific first. Vendor datasheets: A100
# 312 TFLOP/s; H100 SXM 989, PCIe 756, NVL 835 (per GPU); H200 SXM 989, NVL 835.
PEAK_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H100",), 989e12),
    (("H200", "NVL"), 835e12),
    (("H200",), 989e12),
    (("A100",), 312e12),
)


def peak_flops(device_name: str) -> Optional[float]:
    """Datasheet peak bf16 FLOP/s of the accelerator called ``device_name``, or None if unknown."""
    return next((flops for parts, flops in PEAK_FLOPS if all(p in device_name for p in parts)), None)
