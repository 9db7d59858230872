import ray


def test_ray_cluster_runs_a_task_on_a_node_added_with_a_fake_gpu(ray_cluster):
    # A resource no other module's nodes declare, so the task can only land on this node.
    node = ray_cluster.add_node(num_cpus=1, num_gpus=1, resources={"fixture-test-gpu": 1},
                                object_store_memory=100 * 1024 * 1024)
    ray_cluster.wait_for_nodes()

    @ray.remote(num_gpus=1, resources={"fixture-test-gpu": 1})
    def where():
        return ray.get_runtime_context().get_node_id()

    try:
        assert ray.get(where.remote(), timeout=60) == node.node_id
    finally:
        ray_cluster.remove_node(node)
