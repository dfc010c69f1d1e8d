"""Each request parameter's declared pattern (what the OpenAPI document says) accepts exactly
the values its parser accepts; values above a documented maximum are clamped, not refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.api import params
from relay.api.errors import ApiError
from relay.settings import Settings

S = Settings()
PARSERS: dict[str, Callable[[str], Any]] = {
    "recipient": params.recipient_key,
    "channel": params.channel_value,
    "fromSeq": params.from_seq_value,
    "limit": lambda raw: params.limit_value(raw, S),
    "wait": lambda raw: params.wait_value(raw, S),
    "Idempotency-Key": params.idempotency_value,
}
DECLARED = {p.name: p for p in params.PARAMS}  # X-Inbox-ID: matched with its regex in inbox.py


def refusal(name: str, raw: str) -> ApiError | None:
    try:
        PARSERS[name](raw)
    except ApiError as exc:
        return exc
    return None


def accepts(name: str, raw: str) -> bool:
    exc = refusal(name, raw)
    if exc is None:
        return True
    assert (exc.status, exc.code) == (400, DECLARED[name].code)  # the declared refusal
    return False


# drawn from the declared pattern (valid), from its alphabet (mostly lengths and shapes), or anything
def texts(param: params.Param) -> st.SearchStrategy[str]:
    return st.one_of(
        st.from_regex(param.pattern, fullmatch=True),
        st.text(alphabet="AZaz09_-=+/.\n ", max_size=100),
        st.text(max_size=30),
    )


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_declared_pattern_is_what_the_parser_accepts(name: str) -> None:
    param = DECLARED[name]
    matcher = re.compile(param.pattern)

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(raw=texts(param))
    def check(raw: str) -> None:
        if name == "Idempotency-Key" and raw == "":
            return  # a header present but empty: aiohttp never hands it over differently from absent
        assert accepts(name, raw) == bool(matcher.fullmatch(raw)), raw

    check()


def test_integers_and_seconds_above_their_maximum_are_clamped_not_refused() -> None:
    assert params.limit_value("99999999999999999999", S) == S.max_limit == 1000
    assert params.limit_value("0" * 5000 + "7", S) == 7
    assert params.from_seq_value("9" * 5000) == params.MAX_SEQ
    assert params.wait_value("3601", S) == S.max_wait_s == 60
    assert params.wait_value("1" * 400, S) == 60  # float() is inf: clamped like any other
    assert params.wait_value(".5", S) == 0.5
    assert params.limit_value("", S) == S.default_limit
    assert params.from_seq_value("") is None


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("limit", "5\n"),
        ("wait", "1.5\n"),
        ("fromSeq", "3\n"),
        ("channel", "AAAA\n"),
        ("recipient", "A" * 43 + "\n"),
    ],
)
def test_a_trailing_newline_is_refused(name: str, raw: str) -> None:
    """Python's `$` matches before a final newline, JSON Schema's does not: the parsers
    match whole values, as the document says."""
    assert not accepts(name, raw)


def test_a_json_integer_may_be_written_as_an_integral_float() -> None:
    assert params.json_int(5) == 5
    assert params.json_int(5.0) == 5
    assert params.json_int(5.5) is None
    assert params.json_int(True) is None
    assert params.json_int("5") is None
