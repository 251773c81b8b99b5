"""NVML's view of the rank's GPU for its heartbeats: utilization and memory used.

Optional: it needs ``pynvml`` (``nvidia-ml-py``) and a CUDA device; without either it samples
nothing and costs nothing. The rank's device is torch's current device, mapped through
``$CUDA_VISIBLE_DEVICES`` (indices or ``GPU-…`` UUIDs) to NVML's numbering.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class GpuSampler:
    def __init__(self, device: int) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            which = visible[device] if device < len(visible) else str(device)
            if which.startswith("GPU-"):
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(which)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(which))
            self._nvml = pynvml
        except Exception as exc:  # no pynvml, no driver, a MIG or odd device string: sample nothing
            log.debug("rankscope: no NVML samples (%s: %s)", type(exc).__name__, exc)

    def sample(self) -> dict[str, Any]:
        """``gpu_util`` (% of the last sample period a kernel ran) and ``gpu_mem_mb``; {} if unknown."""
        if self._handle is None:
            return {}
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            return {"gpu_util": float(util), "gpu_mem_mb": round(used / (1 << 20), 1)}
        except Exception:
            return {}
