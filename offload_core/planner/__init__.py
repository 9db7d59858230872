"""Planning: facts in, one explainable plan out. Imports no module that holds runtime state.

Owns the facts (from the same layout code the engine runs, on ``meta``), the cost model, the
search over performance modes, the pipeline plan, real-size models on ``meta`` and the CLI
(``offload-serve plan``).

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
