"""GPU presets: the peak rates of the GPUs `HardwareConfig.gpu` may name, for the roofline cost
model (`sched.cost.RooflineCostModel`)."""

from __future__ import annotations

from dualpath_jax.sched.cost import GpuSpec

GPU_PRESETS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 989.4e12, 1978.9e12, 3.35e12, 80e9),
    "h800": GpuSpec("h800", 989.4e12, 1978.9e12, 3.35e12, 80e9),
    "h200": GpuSpec("h200", 989.4e12, 1978.9e12, 4.8e12, 141e9),
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU preset {name!r}; known: {sorted(GPU_PRESETS)}") from None
