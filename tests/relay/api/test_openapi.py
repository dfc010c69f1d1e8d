"""The OpenAPI document matches the implementation, checked by schemathesis against a live relay.

The relay is a `python -m relay` subprocess on a real redis-server (the DIDComm mediator on, so
its routes are exercised too). For every operation schemathesis generates requests from the
document: valid ones must be accepted (2xx, or a 401/404/409/429/503/507 the document lists) and
answered as documented (status, content type, headers, body schema); invalid ones must be
refused with a 4xx; no request at all may get a 5xx. The coverage phase then sends each
parameter's edges one by one. A document that says something the relay does not do fails the
run: `test_a_wrong_document_is_caught` proves it for the bugs this document once had.

Bounded: RELAY_FUZZ_EXAMPLES examples per operation and mode (default 25), derandomized (the
same requests every run), each request at most 10 s. Valid long-polls are shortened to 50 ms
before they are sent (`wait`'s grammar and its 60 s clamp are unit-tested in test_params.py).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from relayfleet_testing.localredis import LocalRedis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    missing_required_header,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from relay.api import params
from relay.api.openapi import document
from relay.app import build_app
from relay.fleet.routing import ShardRouter, single_shard_map
from relay.settings import Settings
from tests.support.fleet_harness import (
    DEBIAN_REDIS,
    RelayProc,
    relay_logs,
    spawn_relay,
    stop_relays,
    wait_ready,
)

pytestmark = pytest.mark.xdist_group("openapi")  # one relay (module fixture) for the module
EXAMPLES = int(os.environ.get("RELAY_FUZZ_EXAMPLES", "25"))


def load(doc: dict[str, Any]) -> Any:
    schema = schemathesis.openapi.from_dict(doc)
    # the relay runs with --auth none (signatures are test_auth.py's): no Authorization is sent,
    # and a request without one is not "invalid"
    schema.config.generation.update(with_security_parameters=False)
    schema.config.phases.coverage.generate_duplicate_query_parameters = True  # `limit=1&limit=x`
    return schema


SCHEMA = load(document())
SHORT_WAIT = "0.05"


def operations(schema: Any) -> list[Any]:
    out = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # the document itself is broken
        out.append(result.ok())
    return out


OPERATIONS = operations(SCHEMA)
# operations with something to get wrong (the others take no input)
WITH_INPUT = [op for op in OPERATIONS if op.path_parameters or op.query or op.headers or op.body]
# a valid request these cannot accept without a secret the generator does not have: a DIDComm
# envelope must decrypt for the mediator's key; a Pickup message without recipient_key names its
# queue by the Authorization header's signature. Their refusals are still checked: 4xx, documented.
NEEDS_A_SECRET = {"POST /v1/didcomm", "POST /v1/didcomm/pickup"}
# WebSocket routes: a plain GET is answered 426 (documented); test_live.py and the DIDComm tests
# speak WebSocket to them
NEEDS_AN_UPGRADE = {"GET /v1/queues/{recipient}/live", "GET /v1/didcomm/ws"}
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def positive_checks(operation: Any) -> list[Any]:
    accepted = [] if operation.label in NEEDS_A_SECRET | NEEDS_AN_UPGRADE else [positive_data_acceptance]
    return [*CONFORMANCE, *accepted]


NEGATIVE_CHECKS = [not_a_server_error, negative_data_rejection]


def coverage_checks(operation: Any) -> list[Any]:
    """The coverage phase also sends each required header left out, and the methods a path
    does not list (405 with Allow)."""
    return [*positive_checks(operation), negative_data_rejection, missing_required_header, unsupported_method]


@schemathesis.serializer("application/didcomm-envelope-enc", "application/ssi-agent-wire")
def _didcomm_body(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    # a DIDComm envelope travels as JSON under its own media type; json, not orjson, so the
    # integers past 64 bits that generation draws are sent too
    return json.dumps(value).encode()


@pytest.fixture(scope="module")
def relay_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("openapi")
    redis_server = LocalRedis(binary=DEBIAN_REDIS, dir=str(workdir / "redis")).start()
    seed = workdir / "seed"  # the mediator on: its paths are fuzzed too
    seed.write_text(os.urandom(32).hex())
    relays: list[RelayProc] = []
    try:
        relays.append(
            spawn_relay(["--redis-url", redis_server.url], workdir, {"RELAY_DIDCOMM_SEED_FILE": str(seed)})
        )
        wait_ready(relays[0])
        yield relays[0].url
        assert relays[0].proc.poll() is None, relay_logs(relays)
    finally:
        stop_relays(relays)
        redis_server.stop()
    assert "Traceback" not in relay_logs(relays)


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def send(case: Any, base_url: str, http: requests.Session) -> Any:
    """The case as generated, but a valid `wait` above SHORT_WAIT is sent as SHORT_WAIT: the
    relay clamps at 60 s, and a run of generated long-polls must stay seconds long."""
    wait = (case.query or {}).get("wait")
    text = wait if isinstance(wait, str) else str(wait)  # a wrong document's number is sent as text
    if text and params.WAIT.regex.fullmatch(text) and float(text) > float(SHORT_WAIT):
        case.query["wait"] = SHORT_WAIT  # accepted or refused as `text` would be: same grammar
    return case.call(base_url=base_url, session=http, timeout=10)


def run_generated(
    operation: Any, mode: GenerationMode, base_url: str, http: requests.Session, checks: list[Any]
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=timedelta(seconds=12),
        database=None,
        derandomize=True,  # the same requests every run: a failure is reproducible
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: Any) -> None:
        case.validate_response(send(case, base_url, http), checks=checks)

    one()


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_valid_requests_are_accepted_and_answered_as_documented(
    operation: Any, relay_url: str, http: requests.Session
) -> None:
    run_generated(operation, GenerationMode.POSITIVE, relay_url, http, positive_checks(operation))


@pytest.mark.parametrize("operation", WITH_INPUT, ids=[op.label for op in WITH_INPUT])
def test_invalid_requests_are_refused_never_with_a_5xx(
    operation: Any, relay_url: str, http: requests.Session
) -> None:
    run_generated(operation, GenerationMode.NEGATIVE, relay_url, http, NEGATIVE_CHECKS)


def run_coverage(
    schema: Any, operation: Any, base_url: str, http: requests.Session, checks: list[Any]
) -> int:
    cases = schema.iter_coverage_cases(
        operation,
        generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        generation_config=schema.config.generation_for(operation=operation, phase="coverage"),
    )
    n = 0
    for n, case in enumerate(cases, 1):  # noqa: B007 (n counts after the loop)
        case.validate_response(send(case, base_url, http), checks=checks)
    return n


@pytest.mark.parametrize("operation", WITH_INPUT, ids=[op.label for op in WITH_INPUT])
def test_boundary_values_are_accepted_or_refused_as_documented(
    operation: Any, relay_url: str, http: requests.Session
) -> None:
    """schemathesis' coverage phase: each parameter's edges (min, max, lengths, types) one by one."""
    assert run_coverage(SCHEMA, operation, relay_url, http, coverage_checks(operation)) > 0


def test_served_document_is_the_valid_openapi_31_document(relay_url: str, http: requests.Session) -> None:
    served = http.get(relay_url + "/v1/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.headers["Content-Type"].startswith("application/json")
    doc = served.json()
    assert doc == document()
    assert doc["openapi"] == "3.1.0"
    SCHEMA.validate()  # against the OpenAPI 3.1 meta-schema


def test_every_route_is_documented_and_every_documented_path_exists() -> None:
    app = build_app(
        Settings(auth="none"), ShardRouter(single_shard_map("redis://127.0.0.1:1/0"), Settings().limits)
    )
    served: set[tuple[str, str]] = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if route.method != "HEAD" and path:
            served.add((route.method.lower(), path))
    documented = {(method, path) for path, ops in document()["paths"].items() for method in ops}
    assert served == documented
    assert all(path.startswith(("/v1/", "/healthz", "/readyz", "/metrics")) for _, path in documented)


DECLARED = [p for p in params.PARAMS if p.where != "path"]
NOT_A_VALUE = {"query": "!", "header": "x" * 600}  # what no declared query value or header takes


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_the_relay_reads_no_parameter_its_operation_leaves_out(
    operation: Any, relay_url: str, http: requests.Session
) -> None:
    """The other direction of the generated checks: a declared parameter the document does not
    list for an operation is not read there (a bad value of it is not refused)."""
    listed = document()["paths"][operation.path][operation.method.lower()].get("parameters", [])
    documented = {(p["in"], p["name"]) for p in listed}
    modes = [GenerationMode.POSITIVE]
    config = SCHEMA.config.generation_for(operation=operation, phase="coverage")
    base = next(
        iter(SCHEMA.iter_coverage_cases(operation, generation_modes=modes, generation_config=config)), None
    )
    checked = 0
    for param in DECLARED:
        if (param.where, param.name) in documented:
            continue
        query, headers = dict(base.query or {}) if base else {}, dict(base.headers or {}) if base else {}
        (query if param.where == "query" else headers)[param.name] = NOT_A_VALUE[param.where]
        case = operation.Case(
            path_parameters=base.path_parameters if base else None,
            query=query,
            headers=headers,
            **({"body": base.body, "media_type": base.media_type} if base and base.media_type else {}),
        )
        answer = send(case, relay_url, http)
        refused = answer.status_code == 400 and answer.json().get("error") == param.error
        assert not refused, f"{operation.label} reads {param.name}, which its document does not list"
        checked += 1
    assert checked > 0


WITH_BODY = [
    (path, method, op["requestBody"])
    for path, ops in document()["paths"].items()
    for method, op in ops.items()
    if "requestBody" in op
]


@pytest.mark.parametrize(
    ("path", "method", "body"), WITH_BODY, ids=[f"{m.upper()} {p}" for p, m, _ in WITH_BODY]
)
def test_each_body_is_read_up_to_its_documented_cap(
    path: str, method: str, body: dict[str, Any], relay_url: str, http: requests.Session
) -> None:
    """x-max-bytes is the cap the handler reads the body under: one byte more is 413."""
    cap = body["x-max-bytes"]
    url = relay_url + path.replace("{recipient}", "A" * 43)
    headers = {"Content-Type": next(iter(body["content"])), "X-Inbox-ID": "inbox-cap"}
    over = http.request(method, url, data=b"{" * (cap + 1), headers=headers, timeout=30)
    assert (over.status_code, over.json()["code"]) == (413, "payload_too_large")
    assert f"max size ({cap} bytes)" in over.json()["error"]
    at = http.request(method, url, data=b"{" * cap, headers=headers, timeout=30)
    assert at.status_code != 413, at.text


# Wrong documents, each a disagreement this document once had or could have: the run must fail.
def _param(doc: dict[str, Any], path: str, name: str) -> dict[str, Any]:
    op = doc["paths"][path]["get"] if "get" in doc["paths"][path] else doc["paths"][path]["post"]
    found: dict[str, Any] = next(p for p in op["parameters"] if p["name"] == name)
    return found


def _wait_maximum(doc: dict[str, Any]) -> str:
    # the hand-written document's `wait`: a number up to 3600 (the relay takes any, clamped)
    _param(doc, "/v1/queues/{recipient}/messages", "wait")["schema"] = {
        "type": "number",
        "minimum": 0,
        "maximum": 3600,
    }
    return "GET /v1/queues/{recipient}/messages"


def _limit_maximum(doc: dict[str, Any]) -> str:
    # an invented upper bound on an integer the relay clamps
    _param(doc, "/v1/inbox/messages", "limit")["schema"] = {"type": "string", "pattern": "^[1-9][0-9]{0,2}$"}
    return "GET /v1/inbox/messages"


def _channel_too_long(doc: dict[str, Any]) -> str:
    # channels of up to 96 bytes promised; the relay takes 64
    _param(doc, "/v1/queues/{recipient}/status", "channel")["schema"]["pattern"] = params.b64url_pattern(
        0, 96
    )
    return "GET /v1/queues/{recipient}/status"


def _seq_a_string(doc: dict[str, Any]) -> str:
    # an answer shape the relay does not send
    doc["components"]["schemas"]["EnqueueResult"]["properties"]["seq"] = {"type": "string"}
    return "POST /v1/queues/{recipient}/messages"


def _missing_status(doc: dict[str, Any]) -> str:
    # a refusal the relay answers but the document does not list
    del doc["paths"]["/v1/queues/{recipient}/ack"]["post"]["responses"]["400"]
    return "POST /v1/queues/{recipient}/ack"


@pytest.mark.parametrize(
    "mutate", [_wait_maximum, _limit_maximum, _channel_too_long, _seq_a_string, _missing_status]
)
def test_a_wrong_document_is_caught(
    mutate: Callable[[dict[str, Any]], str], relay_url: str, http: requests.Session
) -> None:
    doc = copy.deepcopy(document())
    label = mutate(doc)
    schema = load(doc)
    operation = next(op for op in operations(schema) if op.label == label)

    def run_all() -> None:
        run_coverage(schema, operation, relay_url, http, coverage_checks(operation))
        run_generated(operation, GenerationMode.POSITIVE, relay_url, http, positive_checks(operation))
        run_generated(operation, GenerationMode.NEGATIVE, relay_url, http, NEGATIVE_CHECKS)

    with pytest.raises((AssertionError, FailureGroup)):
        run_all()


def test_the_document_is_generated_from_the_parsers_declarations() -> None:
    """Each documented parameter is the declaration its parser matches values against."""
    declared = {p.name: p for p in params.PARAMS}
    seen = set()
    for ops in document()["paths"].values():
        for op in ops.values():
            for p in op.get("parameters", []):
                assert p == declared[p["name"]].openapi()
                seen.add(p["name"])
    assert seen == set(declared)
    assert not any("maximum" in p.openapi()["schema"] for p in declared.values())  # the relay clamps
