"""Residency: how each pipeline component keeps its weights across a request, and the report of it.

Owns the component strategies and the stage lifecycle (prepare_for_use / finish_use), parking of
non-layer weights, host-resident embedding tables (never a tensor-parallel sharded one) and the
where-the-weights-are report.
"""
