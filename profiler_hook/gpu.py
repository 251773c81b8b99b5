"""NVML's view of the rank's GPU: utilization and memory used for its heartbeats, and the device's
faults since attach for its exit record.

Optional: it needs ``pynvml`` (``nvidia-ml-py``) and a CUDA device; without either it samples
nothing and costs nothing. The rank's device is torch's current device, mapped through
``$CUDA_VISIBLE_DEVICES`` (indices or ``GPU-…`` UUIDs) to NVML's numbering.

Faults, as a GPU's node health check reads them (DCGM, the Kubernetes device plugin): the XID
events NVML delivers for the device (critical XIDs and double-bit ECC errors, registered at attach
and drained at each heartbeat, so none waits in NVML's queue until exit), and how far its
uncorrected ECC error count, retired pages and remapped rows moved since attach. A call the device
does not support (ECC off, no row remapping before Ampere) counts nothing.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
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
            return
        self._xids: Counter[int] = Counter()
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
            kinds = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
            pynvml.nvmlDeviceRegisterEvents(self._handle, kinds, self._events)
        except Exception as exc:  # events unsupported (a VM's GPU, an old driver): counters only
            log.debug("rankscope: no NVML events (%s: %s)", type(exc).__name__, exc)
            self._events = None
        self._since = self._counters()

    def sample(self) -> dict[str, Any]:
        """``gpu_util`` (% of the last sample period a kernel ran) and ``gpu_mem_mb``, and where
        the device had any, ``gpu_xids`` (its XID events since attach); {} if unknown."""
        if self._handle is None:
            return {}
        self._drain()
        xids = {"gpu_xids": self._xid_counts()} if self._xids else {}
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            return {"gpu_util": float(util), "gpu_mem_mb": round(used / (1 << 20), 1), **xids}
        except Exception:
            return xids

    def faults(self) -> dict[str, int]:
        """The device's faults since attach: ``xid_<code>`` (events of each XID), and where they
        moved, ``ecc_uncorrected``, ``retired_pages`` and ``remapped_rows``; {} where none or unknown."""
        if self._handle is None:
            return {}
        self._drain()
        now = self._counters()
        moved = {k: n - self._since[k] for k, n in now.items() if k in self._since and n > self._since[k]}
        return {**self._xid_counts(), **moved}

    def _xid_counts(self) -> dict[str, int]:
        return {f"xid_{code}": n for code, n in sorted(self._xids.items())}

    def _drain(self) -> None:
        """Count the XID events NVML holds for the device, without waiting."""
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or getattr(nvml, "nvmlEventSetWait", None)
        if self._events is None or wait is None:
            return
        for _ in range(1000):  # a flood waits for the next heartbeat
            try:
                event = wait(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: none left (or the device is gone)
                return
            if event.eventType & nvml.nvmlEventTypeDoubleBitEccError:
                self._xids[48] += 1  # the driver logs a double-bit ECC error as XID 48
            else:
                self._xids[int(event.eventData)] += 1

    def _counters(self) -> dict[str, int]:
        """The device's fault counters that it supports."""
        nvml, h = self._nvml, self._handle
        reads: dict[str, Callable[[], int]] = {
            "ecc_uncorrected": lambda: int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            ),
            "retired_pages": lambda: sum(
                len(nvml.nvmlDeviceGetRetiredPages(h, cause))
                for cause in (
                    nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                    nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
                )
            ),
            "remapped_rows": lambda: sum(nvml.nvmlDeviceGetRemappedRows(h)[:2]),  # corrected, uncorrected
        }
        out = {}
        for name, read in reads.items():
            try:
                out[name] = read()
            except Exception:  # NVML_ERROR_NOT_SUPPORTED, or no such call in this pynvml
                continue
        return out
