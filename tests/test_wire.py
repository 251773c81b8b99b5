"""Wire records: each round trips, a bad value is refused with its reason, and nothing the hook
sends holds a NaN or an infinity."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rankscope.profiler_hook.shipper import Shipper
from rankscope.wire.records import Heartbeat, RecordError, StepBatch, StepRow, decode, encode
from tests.records import ListSink


def test_records_round_trip_and_bad_values_say_why() -> None:
    batch = StepBatch(
        job="j", rank=3, host="h", time_us=1, rows=(StepRow(1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 11, 12),)
    )
    key, value = encode(batch)
    assert key == b"j/3"
    assert decode(value) == batch
    hb = Heartbeat(job="j", rank=0, host="h", time_us=5, step=7, progress_age_s=0.5, last_seq={"world": 4})
    assert decode(encode(hb)[1]) == hb
    sampled = dataclasses.replace(hb, samples={"train.py(40): load": 9, "": 1})
    assert decode(encode(sampled)[1]) == sampled
    sending = dataclasses.replace(hb, sends={"10.0.0.1>10.0.0.2": (4 << 20, 9_000)})
    assert decode(encode(sending)[1]) == sending
    for bad in ("[1]", "[1, -2]", '"x"', "[1, 2.5]"):
        with pytest.raises(RecordError, match=r"'sends' must be dict\[str, tuple\[int, int\]\]"):
            decode(encode(hb)[1][:-1] + b',"sends":{"a>b":' + bad.encode() + b"}}")
    cases = {
        b"{": "not JSON",
        b'{"v": 99, "type": "steps"}': "unknown schema version",
        b'{"v": 1, "type": "nope"}': "unknown record type",
        b'{"v": 1, "type": "steps", "job": "j"}': "lacks field",
        b'{"v": 1, "type": "steps", "job": 1, "rank": 0, "host": "h", "time_us": 0, "rows": []}': "must be str",
        b'{"v": 1, "type": "steps", "job": "j", "rank": 0, "host": "h", "time_us": 0, "rows": [[1]]}': r"rows\[0\]",
    }
    for raw, reason in cases.items():
        with pytest.raises(RecordError, match=reason):
            decode(raw)
    assert len(encode(hb)[1]) < 130  # fields at their defaults are left out, and read back as such
    # Older values are still read: version 1 (one step per row, nine columns) as rows of one step,
    # versions 1 and 2 (ten columns) with no run-queue wait known, versions 1 to 3 with no
    # garbage collection known.
    unknown_wait = dataclasses.replace(batch, rows=(batch.rows[0]._replace(wait_us=0, gc_us=0),))
    v1 = b'{"v":1,"type":"steps","job":"j","rank":3,"host":"h","time_us":1,"rows":[[1,2,3,4,5,6,7,8,9]]}'
    assert decode(v1) == unknown_wait
    v2 = b'{"v":2,"type":"steps","job":"j","rank":3,"host":"h","time_us":1,"rows":[[1,2,3,4,5,6,7,8,9,1]]}'
    assert decode(v2) == unknown_wait
    v3 = v2.replace(b'"v":2', b'"v":3').replace(b"9,1]", b"9,1,0]")
    assert decode(v3) == unknown_wait
    with pytest.raises(RecordError, match=r"rows\[0\] must be a list of 12 values"):
        decode(v3.replace(b'"v":3', b'"v":4'))


def test_the_hook_never_emits_nan_or_infinity() -> None:
    """A non-finite float is no JSON: encode() refuses it, and the shipper drops and counts it."""
    bad = Heartbeat(job="j", rank=0, host="h", time_us=1, step=3, progress_age_s=math.inf)
    with pytest.raises(ValueError, match="NaN or infinity"):
        encode(bad)
    sink = ListSink()
    shipper = Shipper(sink, 10)
    for record in (bad, dataclasses.replace(bad, coll_age_s=math.nan, progress_age_s=1.0)):
        shipper.submit(record)
    shipper.submit(Heartbeat(job="j", rank=0, host="h", time_us=2, step=4, progress_age_s=0.5))
    shipper.close()
    assert [decode(v).time_us for v in sink.got] == [2]
    assert shipper.dropped == 2
