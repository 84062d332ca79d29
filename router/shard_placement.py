"""Whether a replica's shards can ever be placed: a pure verdict over the cluster's nodes.

A replica is one placement group of ``tensor_parallel_size`` equal bundles, STRICT_PACK: all
of them on one node, where NVLink (or shared memory) joins its shards. Ray leaves a group that
no node can hold pending for ever, waiting for a node the autoscaler may bring; tandem asks
first, so a group that neither the nodes there nor the autoscaler's node types can hold fails
at once, saying what it needs and what the cluster has::

    TP=4 needs 4 GPUs and 4 CPUs on one node; the largest node has 1 GPU

Nodes are compared by their total resources, not what is free now: resources held by another
replica come back when it leaves, so a group that fits a node's total may rightly wait. The
verdict leans to "feasible" where it cannot know: a node type without a count limit, or a
cluster whose autoscaler does not say what it can add (``node_types=None``: Ray 2.60's keep
their node types to themselves), where the group waits for a node as Ray would have it.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Resources = Mapping[str, float]
EPSILON = 1e-9  # Ray's fractional resources are multiples of 1e-4: sums of them may round


@dataclass(frozen=True)
class NodeType:
    """A kind of node Ray's autoscaler can add (a node group of its cluster config)."""

    name: str
    resources: Resources
    max_count: int  # nodes of this type at most; -1: no limit


@dataclass(frozen=True)
class PlacementVerdict:
    feasible: bool
    message: str = ""  # why not: what the replicas need and what the cluster has


def group_needs(bundle: Resources, num_bundles: int) -> dict[str, float]:
    """One replica's resources on its one node."""
    return {name: amount * num_bundles for name, amount in bundle.items() if amount > 0}


def groups_per_node(needs: Resources, node: Resources) -> float:
    """How many whole groups of ``needs`` one node of ``node``'s resources holds."""
    if not needs:
        return math.inf  # a group of nothing fits anywhere
    return min(math.floor(node.get(name, 0.0) / amount + EPSILON)
               for name, amount in needs.items())


def check_placement(bundle: Resources, num_bundles: int, nodes: Sequence[Resources],
                    node_types: Sequence[NodeType] | None = (), num_replicas: int = 1
                    ) -> PlacementVerdict:
    """Can ``num_replicas`` groups of ``num_bundles`` x ``bundle``, each on one node, be placed
    on ``nodes`` (each node's total resources) plus what ``node_types`` can add (empty: no
    autoscaler; None: one that may add nodes of types unknown)?"""
    needs = group_needs(bundle, num_bundles)
    held = sum(groups_per_node(needs, node) for node in nodes)
    if held >= num_replicas or node_types is None:
        return PlacementVerdict(True)
    addable = 0.0
    for node_type in node_types:
        per_node = groups_per_node(needs, node_type.resources)
        if per_node > 0 and node_type.max_count != 0:
            if node_type.max_count < 0:
                return PlacementVerdict(True)
            addable += per_node * node_type.max_count
    if held + addable >= num_replicas:
        return PlacementVerdict(True)
    return PlacementVerdict(False, infeasible_message(needs, num_bundles, nodes, node_types,
                                                      num_replicas, held))


def infeasible_message(needs: Resources, num_bundles: int, nodes: Sequence[Resources],
                       node_types: Sequence[NodeType], num_replicas: int, held: float) -> str:
    wanted = f"TP={num_bundles} needs {amounts(needs)} on one node"
    if num_replicas > 1:
        wanted = f"{num_replicas} replicas: each of them {wanted}"
    if held == 0:
        largest = {name: max((node.get(name, 0.0) for node in nodes), default=0.0)
                   for name in needs}
        short = {name: have for name, have in largest.items() if have + EPSILON < needs[name]}
        if short:
            has = f"the largest node has {amounts(short)}"
        else:  # each resource fits some node, never all on one
            has = f"no node has them together (nodes: {node_list(nodes, needs)})"
    else:
        has = f"the nodes hold {held:g} such {'group' if held == 1 else 'groups'}"
    return f"{wanted}; {has}; {autoscaler_part(node_types, needs)}"


def autoscaler_part(node_types: Sequence[NodeType], needs: Resources) -> str:
    if not node_types:
        return "no autoscaler node types are configured to add a node"
    described = ", ".join(
        f"{t.name} ({amounts({n: t.resources.get(n, 0.0) for n in needs})}, "
        f"{'no limit' if t.max_count < 0 else f'at most {t.max_count}'})" for t in node_types)
    return f"the autoscaler's node types cannot add enough: {described}"


def node_list(nodes: Sequence[Resources], needs: Resources) -> str:
    return "; ".join(amounts({name: node.get(name, 0.0) for name in needs}) for node in nodes)


def amounts(resources: Resources) -> str:
    """{"GPU": 4, "CPU": 1} -> "4 GPUs and 1 CPU"."""
    return " and ".join(f"{amount:g} {name}{'' if amount == 1 else 's'}"
                        for name, amount in resources.items())
