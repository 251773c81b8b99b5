"""How the suite measures how fast the machine ran: other processes taking the cores, not the job
itself, and a healthy job's steps needing more CPU time."""

from __future__ import annotations

import subprocess
import sys

import pytest

_BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass"


def _watch_while(hogs: str, seconds: float = 3.0) -> dict[str, float] | None:
    """The machine's summary over 1.5 s as found, then ``seconds`` with four CPU-bound processes
    started ``hogs`` (``inside`` the harness's process tree, or ``outside`` it)."""
    import time

    from benchmarks import machine

    watch = machine.MachineWatch(every_s=0.1)
    watch.start()
    time.sleep(1.5)
    code = _BUSY.format(s=seconds)
    if hogs == "inside":
        procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(4)]
    else:  # the shell exits at once: its children belong to no process of this test
        cmd = " ".join(f"{sys.executable} -c '{code}' &" for _ in range(4))
        subprocess.run(["sh", "-c", cmd], check=True)
    time.sleep(seconds + 0.3)
    if hogs == "inside":
        for proc in procs:
            proc.wait()
    watch.stop()
    return machine.summary(watch.samples, end=time.time() - 0.5)


@pytest.mark.alone
def test_the_machine_watch_sees_other_processes_take_the_cores_but_not_the_job_itself() -> None:
    from benchmarks import machine

    outside = _watch_while("outside")
    assert outside is not None and outside["capacity"] >= machine.LOST, outside
    inside = _watch_while("inside")
    assert inside is not None and inside["capacity"] < machine.LOST, inside
    assert machine.summary([(0.0, 0.001, 2.0)] * 5) is None, "too few samples to tell"


def test_a_healthy_jobs_steps_needing_more_cpu_time_mean_its_machine_slowed() -> None:
    import pandas as pd

    from benchmarks import machine

    def steps(
        late: float, from_step: int = 40
    ) -> pd.DataFrame:  # 4 ranks x 60 steps; ``late`` x the CPU time
        return pd.DataFrame(
            [
                {"rank": r, "step": i, "cpu_us": 6000 * (late if i >= from_step else 1.0) + 10 * (i % 3)}
                for r in range(4)
                for i in range(60)
            ]
        )

    steady = {"reference": 1.0, "capacity": 1.0}
    assert machine.work(steps(1.0)) == pytest.approx(1.0, abs=0.01)
    assert not machine.slowed({**steady, "work": machine.work(steps(1.0))})
    assert machine.work(steps(1.2)) == pytest.approx(1.2, abs=0.01)
    assert machine.slowed({**steady, "work": machine.work(steps(1.2))})
    assert machine.work(steps(1.2).query("step < 20")) is None, "too few steps a rank to tell"
    # Slower from a quarter into the run on: the job's start against its end, as job_wide reads it.
    assert machine.work(steps(1.2, from_step=15)) == pytest.approx(1.2, abs=0.01)
