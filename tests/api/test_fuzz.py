"""The API fuzzed from its own OpenAPI schema (schemathesis): no input makes it answer 500.

Runs against a service holding the recorded real runs (tests/fixtures) in real chDB, with its
tickets open, with and without a write token; every generated request must get a 2xx, 401/403,
404 or 422 answer — never a server error — and every answer must match the schema's documented
shape where it documents one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from rankscope.aggregator import Store, ingest
from rankscope.api import ServeSettings, Service, create_app
from rankscope.api.auth import Tokens
from rankscope.api.tickets import TicketSettings
from tests.api.common import JOBS, WRITE


@pytest.fixture(scope="module")
def api_schema(spool: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.Schema]:
    with Store.embedded(tmp_path_factory.mktemp("store"), database="fuzz") as store:
        ingest(spool, store)
        svc = Service(store, ServeSettings(spool=str(spool), ended_after_s=1e9))
        now = int(store.jobs()["last_us"].max()) + 1_000_000
        svc.cycle(now_us=now)
        svc.cycle(
            now_us=now + int(TicketSettings().open_after_s * 1e6)
        )  # the slow rank's finding held: a ticket
        assert svc.tickets  # the ticket routes have something to act on
        app = create_app(svc, Tokens({WRITE: "write"}))
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


def test_no_request_makes_a_server_error(api_schema: schemathesis.Schema) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    tickets = sorted(api_schema.app.state.service.tickets)
    assert len(operations) >= 10

    @given(data=st.data())
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(data: st.DataObject) -> None:
        case = data.draw(st.sampled_from(operations).flatmap(lambda op: op.as_strategy()))
        # Mostly known ids: a random one only reaches the 404 (drawn too, as generated).
        for name, known in (("job", JOBS), ("ticket_id", tickets)):
            if case.path_parameters and name in case.path_parameters and data.draw(st.integers(0, 3)):
                case.path_parameters[name] = data.draw(st.sampled_from(known))
        case.call_and_validate(
            headers={"Authorization": f"Bearer {WRITE}"},
            checks=[not_a_server_error, response_schema_conformance],
        )

    check()
