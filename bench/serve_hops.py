"""bench/serve.py's split of a request into hops and stages, and what each adds over Ray Serve's floor.

Pure arithmetic on the wall-clock stamps the stage calls report (``stages[].started_at``, ``seconds``:
the service's StageStats, bench/serve_floor.py's no-op stages alike), in the bench's process; no
Ray, no torch, so tests check it without deploying anything.
"""
from __future__ import annotations

# A request's timeline, from the stage calls' (started_at, seconds) in the response: hops and stages in turn.
STAGES = ("encode", "denoise", "decode")
PARTS = ("in", "encode", "encode_to_denoise", "denoise", "denoise_to_decode", "decode", "out")  # in time order


def timeline(sent_at: float, received_at: float, stages: list[dict]) -> dict[str, float]:
    """Seconds of each hop and stage of one request (wall clock of this machine, one clock for all)."""
    (enc, den, dec) = ((s["started_at"], s["started_at"] + s["seconds"]) for s in stages)
    return {"in": enc[0] - sent_at, "encode": enc[1] - enc[0], "encode_to_denoise": den[0] - enc[1],
            "denoise": den[1] - den[0], "denoise_to_decode": dec[0] - den[1], "decode": dec[1] - dec[0],
            "out": received_at - dec[1]}


def where_it_goes(service: dict[str, float], floor: dict[str, float], in_process: dict[str, float],
                  offload_s: float, over_floor_s: float) -> tuple[dict[str, dict], dict[str, float]]:
    """Per hop and stage: the medians (ms) of the service, the floor, and for a stage the same call in
    process; and what each adds over the floor (ms): a hop the service's minus the floor's (out also
    minus the PNG encoding the in-process column pays too), a stage its replica's minus in process."""
    rows, over = {}, {}
    for name in PARTS:
        row = {"service": round(service[name] * 1e3, 2), "floor": round(floor[name] * 1e3, 2)}
        if name in STAGES:
            row["in_process"] = round(in_process[name] * 1e3, 2)
            extra = service[name] - floor[name] - in_process[name]
        else:
            extra = service[name] - floor[name] - (in_process["png"] if name == "out" else 0.0)
        rows[name], over[name] = row, round(extra * 1e3, 2)
    over["offload_in_process"] = round(offload_s * 1e3, 2)
    over["median_arithmetic"] = round(over_floor_s * 1e3 - sum(over.values()), 2)  # medians do not add up
    return rows, over
