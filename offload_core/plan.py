"""``python -m offload_core.plan``: the planner's command line (see ``offload_core.planner.cli``)."""
from offload_core.planner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
