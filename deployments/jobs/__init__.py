"""Video jobs: their records and SQLite table, the queue actor (its own detached process on the head
node), the runner that drives a job through the stages (in every ingress replica) and the finished
results. No FastAPI here: the routes that serve jobs are in :mod:`deployments.api`."""
