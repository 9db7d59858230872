"""The application's one job queue behind a named actor on the head node (its own process).

Every ingress replica reaches the same :class:`JobQueueActor` by name (get-or-create), so a job
created through one replica is seen, run and served by any; the actor is detached, so it outlives
the replicas, and it is restarted by Ray if it dies, reopening the same file (jobs that were running
go back in the queue). The ingress sees it through :class:`deployments.jobs.queue.JobQueue`.
"""
from __future__ import annotations

import ray

from compat.ray import on_head_node
from deployments.jobs.queue import AsyncJobQueue, JobQueueService, JobsArgs

WAITERS = 32


# The queue is light (a few SQLite rows per call): no CPU of its own, so it never blocks scheduling.
# Its calls run one at a time, as before, except the runners' waits for work: each holds a thread of
# their own group until a job is queued (a replica's runner has at most one wait in flight; 32 covers
# 32 ingress replicas, and a 33rd's wait queues behind one that ends within its poll interval).
@ray.remote(num_cpus=0, max_restarts=-1, concurrency_groups={"waits": WAITERS})
class JobQueueActor(JobQueueService):
    @ray.method(concurrency_group="waits")
    def wait_for_work(self, wait_s: float) -> bool:
        return JobQueueService.wait_for_work(self, wait_s)


class ActorJobQueue(AsyncJobQueue):
    def __init__(self, actor):
        self._actor = actor

    async def _call(self, method: str, *args):
        return await getattr(self._actor, method).remote(*args)


def queue_name(app_name: str) -> str:
    return f"offload-serve-jobs:{app_name}"


def get_job_queue(app_name: str, args: JobsArgs) -> ActorJobQueue:
    """The application's queue actor, created on first use, on the head node (whose disk holds the file)."""
    actor = JobQueueActor.options(name=queue_name(app_name), namespace="serve", lifetime="detached",
                                  get_if_exists=True, resources=on_head_node()
                                  ).remote(app_name, args)
    return ActorJobQueue(actor)


def drop_job_queue(app_name: str) -> bool:
    """Kill the application's queue actor (its file stays); True if there was one."""
    try:
        actor = ray.get_actor(queue_name(app_name), namespace="serve")
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
