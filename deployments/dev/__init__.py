"""For one machine: ``make demo`` and ``make serve`` (a loopback Ray head with token auth, the
service deployed on it), run in the user's own process; never imported by the service."""
