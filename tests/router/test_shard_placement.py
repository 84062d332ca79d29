"""The placement verdict over plain node resources: fits, fits after the autoscaler adds a
node, never fits (and the message that says why)."""

from router.shard_placement import NodeType, check_placement

GPU_SHARD = {"GPU": 1.0, "CPU": 1.0}
CPU_SHARD = {"CPU": 0.25}
ONE_GPU_NODE = {"GPU": 1.0, "CPU": 16.0, "memory": 1e11}
EIGHT_GPU_NODE = {"GPU": 8.0, "CPU": 128.0}


def test_four_cpu_shards_of_a_quarter_fit_one_cpu():
    assert check_placement(CPU_SHARD, 4, [{"CPU": 1.0}]).feasible
    assert check_placement(CPU_SHARD, 8, [{"CPU": 2.0}]).feasible


def test_tp_4_on_nodes_of_one_gpu_says_what_it_needs_and_what_there_is():
    verdict = check_placement(GPU_SHARD, 4, [ONE_GPU_NODE, ONE_GPU_NODE])
    assert not verdict.feasible
    assert verdict.message == ("TP=4 needs 4 GPUs and 4 CPUs on one node; the largest node has "
                               "1 GPU; no autoscaler node types are configured to add a node")


def test_shards_of_one_replica_are_never_split_across_nodes():
    # 8 GPUs in all, but 4 on each node: TP=8 is STRICT_PACK, one node
    half = {"GPU": 4.0, "CPU": 64.0}
    verdict = check_placement(GPU_SHARD, 8, [half, half])
    assert not verdict.feasible and "the largest node has 4 GPUs;" in verdict.message
    assert check_placement(GPU_SHARD, 4, [half, half], num_replicas=2).feasible


def test_a_node_short_of_every_resource_names_them_all():
    verdict = check_placement(GPU_SHARD, 2, [{"CPU": 1.0}])
    assert verdict.message.startswith("TP=2 needs 2 GPUs and 2 CPUs on one node; the largest "
                                      "node has 0 GPUs and 1 CPU;")


def test_resources_on_different_nodes_are_not_one_node():
    verdict = check_placement(GPU_SHARD, 2, [{"GPU": 2.0, "CPU": 1.0}, {"CPU": 8.0}])
    assert not verdict.feasible
    assert verdict.message.startswith("TP=2 needs 2 GPUs and 2 CPUs on one node; no node has "
                                      "them together (nodes: 2 GPUs and 1 CPU; 0 GPUs and "
                                      "8 CPUs);")


def test_an_autoscaler_node_type_that_holds_the_group_makes_it_feasible():
    eight = NodeType("gpu-8", EIGHT_GPU_NODE, max_count=2)
    assert check_placement(GPU_SHARD, 8, [ONE_GPU_NODE], [eight]).feasible
    # two nodes of 8 GPUs hold four TP=4 replicas, not five
    assert check_placement(GPU_SHARD, 4, [ONE_GPU_NODE], [eight], num_replicas=4).feasible
    verdict = check_placement(GPU_SHARD, 4, [ONE_GPU_NODE], [eight], num_replicas=5)
    assert not verdict.feasible
    assert verdict.message == ("5 replicas: each of them TP=4 needs 4 GPUs and 4 CPUs on one "
                               "node; the largest node has 1 GPU; the autoscaler's node types "
                               "cannot add enough: gpu-8 (8 GPUs and 128 CPUs, at most 2)")


def test_node_types_without_a_limit_or_too_small_or_switched_off():
    unlimited = NodeType("gpu-8", EIGHT_GPU_NODE, max_count=-1)
    assert check_placement(GPU_SHARD, 8, [], [unlimited], num_replicas=100).feasible
    small = NodeType("gpu-1", ONE_GPU_NODE, max_count=-1)
    off = NodeType("gpu-8", EIGHT_GPU_NODE, max_count=0)
    verdict = check_placement(GPU_SHARD, 2, [ONE_GPU_NODE], [small, off])
    assert not verdict.feasible
    assert verdict.message.endswith("the autoscaler's node types cannot add enough: gpu-1 (1 GPU "
                                    "and 16 CPUs, no limit), gpu-8 (8 GPUs and 128 CPUs, at "
                                    "most 0)")


def test_several_replicas_count_whole_groups_per_node():
    node = {"CPU": 2.0}  # a TP=8 CPU replica asks 2 CPUs: one a node
    assert check_placement(CPU_SHARD, 8, [node, node], num_replicas=2).feasible
    verdict = check_placement(CPU_SHARD, 8, [node, node], num_replicas=3)
    assert verdict.message.startswith("3 replicas: each of them TP=8 needs 2 CPUs on one node; "
                                      "the nodes hold 2 such groups;")


def test_an_autoscaler_that_does_not_say_what_it_adds_leaves_the_group_to_wait():
    """A cluster joined whose autoscaler reports no node types: a node may come (Ray's own
    behaviour, a pending group); only a cluster known to have no autoscaler refuses."""
    assert check_placement(GPU_SHARD, 4, [{"CPU": 8.0, "GPU": 0.0}], None).feasible
    assert not check_placement(GPU_SHARD, 4, [{"CPU": 8.0, "GPU": 0.0}], []).feasible
