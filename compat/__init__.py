"""One seam per library: every use of torch's, diffusers', Ray's and Starlette's private API.

A private name (an underscore module or attribute) can move or vanish in any release. Each library's
uses live in one module here (:mod:`compat.torch`, :mod:`compat.diffusers`, :mod:`compat.ray`,
:mod:`compat.starlette`), one function per private use, each registered with the library versions
it was checked against (:class:`compat.checked.PrivateUse`); ``tests/compat/`` asserts that every
one still exists and behaves as relied on, so an upgrade that moved one fails there, loudly, and
nowhere else. ``tests/test_private_names.py`` fails when a private name of these libraries is
used outside this package.

Why a top-level package, below ``offload_core``: the seams are needed on every floor (the engine
needs torch's and diffusers', the ledger Ray's, the HTTP API Starlette's), and a home inside one
floor could not be imported by the floors below it. Here nothing imports the project, and each
module imports only its own library, lazily where the library is slow to import (diffusers, Ray),
so importing a seam drags nothing in: ``offload_core`` still reaches no Ray or Starlette, and the
HTTP API no Ray (the import contracts in pyproject.toml check the chains through this package).
This ``__init__`` imports none of its modules for the same reason.

Where a public API does the job, the project uses it instead and no seam exists (each module's
docstring lists those). Runs in whichever process calls it.
"""
