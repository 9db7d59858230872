"""The router's decision rules, one test each (deployments/routing/choice.py), on plain loads."""
import random

import pytest

from deployments.capacity.replica_load import PlanSummary, QueuedWork, ReplicaLoad, Shape, StepTiming
from deployments.routing.choice import STUCK_FLOOR_S, STUCK_STEPS, Candidate, Rule, choose, spread

IMAGE = Shape(512, 512, 1)
VIDEO = Shape(512, 512, 9)
NOW = 1000.0
STALE_AFTER = 2.0


def load(timings: dict, running=(), waiting=(), gpu="L4", at=NOW - 0.1, progress=None) -> ReplicaLoad:
    steps = tuple(StepTiming(shape, 1, s, 10) for shape, s in timings.items())
    return ReplicaLoad(gpu, PlanSummary("balanced", 0, 40, 1.0), 4, tuple(running), tuple(waiting), steps, at,
                       progress)


def first(choice) -> str:
    return choice.ranked[0][0]


def test_earliest_predicted_finish_wins_over_a_shorter_queue_on_a_slower_replica():
    # fast: 2 requests queued (16 steps at 0.1 s: 1.6 s); slow: 1 request (4 steps at 0.5 s: 2 s). The
    # new image finishes at 2.6 s on fast, 7 s on slow: the longer queue is the shorter wait.
    fast = load({IMAGE: 0.1, VIDEO: 0.1}, running=[QueuedWork(IMAGE, 8)], waiting=[QueuedWork(VIDEO, 8)], gpu="H100")
    slow = load({IMAGE: 0.5, VIDEO: 0.5}, running=[QueuedWork(VIDEO, 4)], gpu="L4")
    made = choose([Candidate("slow", slow), Candidate("fast", fast)], IMAGE, 10, NOW, STALE_AFTER)
    assert made.rule is Rule.PREDICTED
    assert first(made) == "fast"
    assert made.prediction("fast").finish_s < made.prediction("slow").finish_s


def test_joining_a_running_batch_costs_less_than_waiting_behind_less_work():
    # a: an image batch with room, 10 steps left (10 s of work): the new image joins it at the next
    # boundary (1 s), 9 steps together at 1.25 s, its last alone: 13.25 s (less the 0.1 s since the stats).
    # b: a video with 4 steps left (4 s of work): the image waits for it, 4 + 10 x 1 s = 14 s (less 0.1 s).
    a = load({IMAGE: 1.0, VIDEO: 1.0}, running=[QueuedWork(IMAGE, 10)])
    b = load({IMAGE: 1.0, VIDEO: 1.0}, running=[QueuedWork(VIDEO, 4)])
    made = choose([Candidate("b", b), Candidate("a", a)], IMAGE, 10, NOW, STALE_AFTER)
    assert first(made) == "a"
    assert made.prediction("a").joins_running and not made.prediction("b").joins_running
    assert made.prediction("a").finish_s == pytest.approx(13.15)


def test_a_replica_without_stats_leaves_the_choice_to_serves_power_of_two():
    made = choose([Candidate("new", None), Candidate("a", load({IMAGE: 0.1})), Candidate("b", load({IMAGE: 0.2}))],
                  IMAGE, 4, NOW, STALE_AFTER, random.Random(0))
    assert made.rule is Rule.DEFAULT
    assert len(made.ranked) == 1 and len(made.ranked[0]) == 2  # one rank of two: Serve probes both queues
    assert made.predictions == ()


def test_stale_stats_exclude_the_replica_however_fast():
    hung = load({IMAGE: 0.01}, gpu="H100", at=NOW - STALE_AFTER - 0.01)
    made = choose([Candidate("hung", hung), Candidate("slow", load({IMAGE: 1.0}))], IMAGE, 4, NOW, STALE_AFTER)
    assert [r for rank in made.ranked for r in rank] == ["slow"]
    assert made.stale == ("hung",)


def test_when_every_replica_is_stale_requests_still_go_to_one_of_them():
    # CI: during a config update the controller polled no Denoiser for 35 s; holding requests until
    # stats were fresh again kept two of them 120 s in the router, until their clients gave up.
    hung = load({IMAGE: 0.01}, gpu="H100", at=NOW - STALE_AFTER - 0.01)
    slow = load({IMAGE: 1.0}, at=NOW - 10 * STALE_AFTER)
    only_hung = choose([Candidate("hung", hung)], IMAGE, 4, NOW, STALE_AFTER)
    assert only_hung.rule is Rule.NONE_FRESH and only_hung.ranked == (("hung",),)
    both = choose([Candidate("hung", hung), Candidate("slow", slow)], IMAGE, 4, NOW, STALE_AFTER, random.Random(0))
    assert both.rule is Rule.NONE_FRESH and sorted(both.ranked[0]) == ["hung", "slow"]
    assert both.stale == ("hung", "slow")
    assert spread([Candidate("hung", hung)], NOW, STALE_AFTER).ranked == (("hung",),)


def test_the_cost_of_a_step_is_the_replicas_own_at_the_requests_shape():
    # a is quick at images and slow at videos (it streams more at a video's activations), b the reverse.
    a = load({IMAGE: 0.1, VIDEO: 2.0})
    b = load({IMAGE: 0.3, VIDEO: 0.5})
    assert first(choose([Candidate("a", a), Candidate("b", b)], IMAGE, 8, NOW, STALE_AFTER)) == "a"
    assert first(choose([Candidate("a", a), Candidate("b", b)], VIDEO, 8, NOW, STALE_AFTER)) == "b"


def test_requests_sent_since_the_stats_count_as_queued():
    a, b = load({IMAGE: 0.1}), load({IMAGE: 0.15})
    assert first(choose([Candidate("a", a), Candidate("b", b)], IMAGE, 10, NOW, STALE_AFTER)) == "a"
    # Five images sent to a since its stats: the batch of 4 and one behind it (~3.1 s) beat b's idle 1.5 s.
    sent = ((0.0, QueuedWork(IMAGE, 10)),) * 5
    assert first(choose([Candidate("a", a, sent), Candidate("b", b)], IMAGE, 10, NOW, STALE_AFTER)) == "b"


def test_a_running_batch_without_a_forward_for_ten_steps_and_the_floor_gets_no_work_while_another_serves():
    # Fresh stats, but its batch thread is hung: no forward since 31 s (10 steps of 0.1 s are 1 s; the
    # floor, 30 s, decides). A video's 4 s steps: 10 of them (40 s) before it counts as stuck.
    at = NOW - 0.1
    hung = load({IMAGE: 0.1}, running=[QueuedWork(IMAGE, 8)], gpu="H100", at=at, progress=at - STUCK_FLOOR_S - 1)
    slow = load({IMAGE: 1.0})
    made = choose([Candidate("hung", hung), Candidate("slow", slow)], IMAGE, 4, NOW, STALE_AFTER)
    assert [r for rank in made.ranked for r in rank] == ["slow"] and made.stale == ("hung",)
    busy = load({IMAGE: 0.1}, running=[QueuedWork(IMAGE, 8)], gpu="H100", at=at, progress=at - STUCK_FLOOR_S + 1)
    assert first(choose([Candidate("busy", busy), Candidate("slow", slow)], IMAGE, 4, NOW, STALE_AFTER)) == "busy"
    video = load({VIDEO: 4.0}, running=[QueuedWork(VIDEO, 8)], at=at, progress=at - STUCK_STEPS * 4.0 + 1)
    assert choose([Candidate("video", video), Candidate("slow", slow)], IMAGE, 4, NOW, STALE_AFTER).stale == ()
    idle = load({IMAGE: 0.1}, at=at, progress=at - 1000)  # nothing running: an old progress time means nothing
    assert choose([Candidate("idle", idle)], IMAGE, 4, NOW, STALE_AFTER).rule is Rule.PREDICTED
