"""The property both API surfaces must hold under generated requests: never a 5xx, and every
error the OpenAI object."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings


def status_codes_never_5xx(client, requests, examples: int) -> list[int]:
    """Send ``examples`` requests drawn from the ``requests`` strategy through ``client``; fail on
    any 5xx or any 4xx body that is not the OpenAI error object. Returns every status seen."""
    seen: list[int] = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests)
    def check(request):
        response = client.request(**request)
        seen.append(response.status_code)
        assert response.status_code < 500, (request, response.text[:300])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text[:300]

    check()
    return seen
