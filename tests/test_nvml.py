"""NVML's view of a rank's GPU (``profiler_hook.gpu``): its samples, and its faults since attach.
No GPU here: a stand-in ``pynvml`` answers as NVML's API documents."""

from __future__ import annotations

import sys

import pytest


def test_nvml_samples_the_ranks_own_gpu_through_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a stand-in ``pynvml`` module answers as NVML would, to test the mapping and
    the samples; on a GPU the real one does (nothing here needs it)."""
    from types import SimpleNamespace

    from rankscope.profiler_hook.gpu import GpuSampler

    asked: list[tuple[str, object]] = []  # the device handles NVML is asked about
    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
        nvmlDeviceGetHandleByUUID=lambda u: ("uuid", u),
        nvmlDeviceGetUtilizationRates=lambda h: asked.append(h) or SimpleNamespace(gpu=87),
        nvmlDeviceGetMemoryInfo=lambda h: asked.append(h) or SimpleNamespace(used=3 << 30),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-5f2e")
    first, second = GpuSampler(0), GpuSampler(1)
    assert first.sample() == {"gpu_util": 87.0, "gpu_mem_mb": 3072.0}
    assert second.sample() == {"gpu_util": 87.0, "gpu_mem_mb": 3072.0}
    assert asked == [("index", 3), ("index", 3), ("uuid", "GPU-5f2e"), ("uuid", "GPU-5f2e")]
    fake.nvmlDeviceGetUtilizationRates = lambda h: (_ for _ in ()).throw(RuntimeError("GPU is lost"))
    assert first.sample() == {}, "a failing NVML call gives no sample, never an exception"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert GpuSampler(0).sample() == {}


def test_nvml_tells_the_gpus_faults_since_attach_for_the_exit_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a stand-in ``pynvml`` answers as NVML's API documents (an event set that holds
    the device's XID and double-bit ECC events until waited on, and its fault counters)."""
    from types import SimpleNamespace

    from rankscope.profiler_hook.gpu import GpuSampler

    class Timeout(Exception):  # pynvml.NVMLError_Timeout
        pass

    queued: list[SimpleNamespace] = []
    counters = {"ecc": 5, "pages": [[0x1000, 1]], "rows": (1, 0, False, False)}  # before attach
    registered: list[int] = []

    def wait(event_set: object, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "never waits"
        if not queued:
            raise Timeout()
        return queued.pop(0)

    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=50),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=1 << 30),
        nvmlEventTypeXidCriticalError=8,
        nvmlEventTypeDoubleBitEccError=4,
        nvmlEventSetCreate=lambda: "set",
        nvmlDeviceRegisterEvents=lambda h, kinds, s: registered.append(kinds),
        nvmlEventSetWait_v2=wait,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlDeviceGetTotalEccErrors=lambda h, kind, where: counters["ecc"],
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS=0,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1,
        nvmlDeviceGetRetiredPages=lambda h, cause: counters["pages"] if cause == 1 else [],
        nvmlDeviceGetRemappedRows=lambda h: counters["rows"],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = GpuSampler(0)
    assert registered == [8 | 4]
    assert gpu.faults() == {}, "counts from attach: a GPU's old errors are not this job's"
    assert gpu.sample() == {"gpu_util": 50.0, "gpu_mem_mb": 1024.0}, "no XID yet: none in the heartbeat"
    queued += [SimpleNamespace(eventType=8, eventData=79), SimpleNamespace(eventType=8, eventData=13)]
    # A heartbeat drains the queue and carries the XIDs so far (a rank killed without a word leaves them)...
    assert gpu.sample() == {"gpu_util": 50.0, "gpu_mem_mb": 1024.0, "gpu_xids": {"xid_13": 1, "xid_79": 1}}
    assert not queued
    queued += [SimpleNamespace(eventType=4, eventData=0), SimpleNamespace(eventType=8, eventData=79)]
    counters.update(ecc=7, pages=[[0x1000, 1], [0x2000, 1]], rows=(1, 1, False, False))
    # ...and the exit record has every event since attach, and how far each counter moved.
    assert gpu.faults() == {
        "xid_13": 1, "xid_48": 1, "xid_79": 2, "ecc_uncorrected": 2, "retired_pages": 1, "remapped_rows": 1,
    }  # fmt: skip
    # A device without row remapping (before Ampere) or ECC: those counters are left out, no error.
    fake.nvmlDeviceGetRemappedRows = fake.nvmlDeviceGetTotalEccErrors = lambda *a: (_ for _ in ()).throw(
        Timeout()
    )
    assert GpuSampler(0).faults() == {}
