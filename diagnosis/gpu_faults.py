"""A GPU's faults since the rank's hook attached, as its exit record and heartbeats carry them
(``profiler_hook.gpu``: ``xid_<code>`` → events, and how far ``ecc_uncorrected``,
``retired_pages`` and ``remapped_rows`` moved): which of them are its hardware's, and in words."""

from __future__ import annotations

HARDWARE_XIDS = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
"""The XIDs that NVIDIA's XID catalog resolves by resetting or replacing the GPU, not the
application (13, 31, 43 and 45, the application's own faults, are not here)."""
GPU_COUNTERS = {
    "ecc_uncorrected": "uncorrected ECC errors",
    "retired_pages": "retired pages",
    "remapped_rows": "remapped rows",
}
"""The exit record's GPU counters (how far each moved since attach), in words."""


def gpu_failed(gpu: dict[str, int]) -> bool:
    """Whether a GPU's faults since attach are its hardware's: a hardware XID, or an ECC error
    count, retired pages or remapped rows that moved."""
    return any(k in GPU_COUNTERS for k in gpu) or any(
        k.startswith("xid_") and int(k[4:]) in HARDWARE_XIDS for k in gpu
    )


def gpu_faults(gpu: dict[str, int]) -> str:
    """A GPU's faults in words (``XID 79 (GPU has fallen off the bus), 2 uncorrected ECC
    errors``); "" where none."""
    xids = sorted((int(k[4:]), n) for k, n in gpu.items() if k.startswith("xid_"))
    parts = [
        f"XID {code}"
        + (f" ({HARDWARE_XIDS[code]})" if code in HARDWARE_XIDS else "")
        + (f" x{n}" if n > 1 else "")
        for code, n in xids
    ]
    parts += [f"{gpu[k]} {words}" for k, words in GPU_COUNTERS.items() if gpu.get(k)]
    return ", ".join(parts)
