"""What a replica's shards ask Ray for, and a refusal at once when no node can ever hold them.

The verdict is router/shard_placement.py's, over the nodes Ray lists now and the node types
its autoscaler reports in its cluster config (see autoscaler_node_types for where that is not
known).
"""

import ray

from router.shard_placement import NodeType, Resources, check_placement

# A CPU shard's share of a core: CPU replicas are tests and small models, whose shards spend
# most of a step waiting for each other in gloo. Four to a core let TP=8 fit a 2-core machine;
# one CPU each made TP=4 wait for ever there for a placement group two CPUs cannot hold.
CPU_SHARD_CPUS = 0.25


class PlacementInfeasible(ValueError):
    """No node of the cluster, and none its autoscaler can add, holds a replica's shards."""


def shard_bundle(on_gpu: bool, gpu_fraction: float,
                 cpu_shard_cpus: float = CPU_SHARD_CPUS) -> dict[str, float]:
    """One shard's bundle of the replica's placement group."""
    return {"GPU": gpu_fraction, "CPU": 1.0} if on_gpu else {"CPU": cpu_shard_cpus}


def cluster_nodes() -> list[dict[str, float]]:
    """The total resources of every live node."""
    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def autoscaler_node_types() -> list[NodeType] | None:
    """The node types Ray's autoscaler may add, from the cluster config it reports to the GCS
    (what Ray Data reads too; no public API reads it). None where that is unknown: Ray 2.60's
    autoscalers (v1, and v2 under KubeRay) report none, so on a cluster this process joined
    a group may still be met by a node to come. A Ray instance this process started itself
    (``ray.init()`` without an address) has no autoscaler: its nodes decide."""
    from ray._private import worker
    from ray._private.state import state

    config = state.get_cluster_config()
    if config is not None and config.node_group_configs:
        return [NodeType(group.name, dict(group.resources), group.max_count)
                for group in config.node_group_configs]
    node = worker._global_node
    return [] if node is not None and node.head else None


def check_placeable(bundle: Resources, tensor_parallel_size: int, num_replicas: int = 1) -> None:
    """Raises PlacementInfeasible (saying what is needed and what there is) when the replicas'
    placement groups could never be placed; returns when they can, now or once Ray's
    autoscaler adds nodes."""
    verdict = check_placement(bundle, tensor_parallel_size, cluster_nodes(),
                              autoscaler_node_types(), num_replicas)
    if not verdict.feasible:
        raise PlacementInfeasible(verdict.message)
