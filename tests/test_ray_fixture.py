import ray


def test_ray_cluster_runs_a_task_and_accepts_a_gpu_node(ray_cluster):
    node = ray_cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:L4": 1},
                                object_store_memory=100 * 1024 * 1024)
    ray_cluster.wait_for_nodes()

    @ray.remote(num_gpus=1, resources={"accelerator_type:L4": 0.001})
    def where():
        return ray.get_runtime_context().get_node_id()

    assert ray.get(where.remote(), timeout=60) == node.node_id
    ray_cluster.remove_node(node)
