from pathlib import Path

import ray

from offload_core.shared_store.files import DEFAULT_STORE_DIR, store_dir
from tests.conftest import QUIET_NODE


def test_ray_cluster_runs_a_task_on_a_node_added_with_a_fake_gpu(ray_cluster):
    # A resource no other module's nodes declare, so the task can only land on this node.
    node = ray_cluster.add_node(**QUIET_NODE, num_cpus=1, num_gpus=1, resources={"fixture-test-gpu": 1},
                                object_store_memory=100 * 1024 * 1024)
    ray_cluster.wait_for_nodes()

    @ray.remote(num_gpus=1, resources={"fixture-test-gpu": 1})
    def where():
        return ray.get_runtime_context().get_node_id()

    try:
        assert ray.get(where.remote(), timeout=60) == node.node_id
    finally:
        ray_cluster.remove_node(node)


def test_the_clusters_workers_keep_weight_stores_in_a_folder_of_this_clusters_own(ray_cluster):
    """make test's two workers each run a cluster, and a store's file name is the digest of what it holds:
    in one shared folder, one cluster's ledger would remove the other's live store file when its own last
    replica left (the ledger's detach unlinks it), and the other's later replicas would host privately."""
    @ray.remote(num_cpus=0)
    def worker_store_dir():
        return str(store_dir())

    folder = ray.get(worker_store_dir.remote(), timeout=60)
    assert folder == str(store_dir()) and folder != DEFAULT_STORE_DIR, folder
    assert Path(folder).is_dir()


def test_the_head_runs_serves_controller_loop_every_quarter_second_and_this_process_keeps_its_own(ray_cluster):
    """The head's workers (Serve's controller among them) have the interval; the test process does not, so a
    head started later from it (the serve command's) keeps Ray's default."""
    import os

    from tests.conftest import CONTROL_LOOP_ENV, CONTROL_LOOP_S

    @ray.remote(num_cpus=0, resources={"node:__internal_head__": 0.001})
    def interval():
        from ray.serve._private.constants import CONTROL_LOOP_INTERVAL_S

        return os.environ.get(CONTROL_LOOP_ENV), CONTROL_LOOP_INTERVAL_S

    mine = os.environ.get(CONTROL_LOOP_ENV)  # None unless whoever ran the tests set one (the head then has it)
    on_head = mine or CONTROL_LOOP_S
    assert ray.get(interval.remote(), timeout=60) == (on_head, float(on_head))
