"""The server against its own OpenAPI document (schemathesis, bounded): no 5xx, only documented status codes
and content types, responses in the documented shapes, a 405 with its Allow header, and bodies that break the
schema (wrong types, out-of-range numbers, `true` for a number) rejected."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance, unsupported_method)
from schemathesis.generation import GenerationMode

from tests.conftest import serving

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection, unsupported_method]


@pytest.fixture(scope="module")
def api(tiny_run):
    with serving(tiny_run, "--max-batch-size", "4") as url:
        yield schemathesis.openapi.from_url(url + "/openapi.json")


BODIES = ["POST /v1/completions", "POST /v1/chat/completions"]
CASES = [(label, mode) for label in BODIES for mode in GenerationMode] + \
    [(label, GenerationMode.POSITIVE) for label in ("GET /v1/models", "GET /health", "GET /metrics")]  # no inputs


@pytest.mark.parametrize("label,mode", CASES)
def test_api_conforms_to_its_document(api, label, mode):
    method, path = label.split()
    operation = api[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        case.call_and_validate(checks=CHECKS, timeout=30)

    check()
