"""The router's decision time: ``ReplicaRouter.assign`` with many replicas and a large directory.

A directory of ``--blocks`` cached blocks spread over ``--replicas`` replicas (as chains of
``--prefix-blocks``: one cached prefix each), then requests whose prompts share one of those
prefixes (or none) and add a question; each decision is timed alone, with ``--in-flight``
requests placed and not yet released. Pure Python, no Ray: what the router actor spends.

    python -m tools.profile.routing --replicas 16 --blocks 1000000
"""

import argparse
import json
import random
import statistics
import time

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import EventBatch
from kvstore.events import BlockStored
from router.replica_router import ReplicaRouter

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--prefix-blocks", type=int, default=128)  # a 2,048-token prefix
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--policy", default="prefix-affinity")
    args = parser.parse_args()
    rng = random.Random(0)
    router = ReplicaRouter(args.replicas, args.policy)
    prefixes = []
    built = time.perf_counter()
    for index in range(args.blocks // args.prefix_blocks):
        tokens = [rng.randrange(50000) for _ in range(args.prefix_blocks * BLOCK)]
        hashes = hash_full_blocks(tokens, BLOCK)
        replica = index % args.replicas
        router.report(EventBatch(replica, "e", router.directory.replicas[replica].next_seq,
                                 tuple(BlockStored(h, None) for h in hashes)))
        prefixes.append(tokens)
    built = time.perf_counter() - built
    seconds = []
    for index in range(args.decisions):
        shared = prefixes[rng.randrange(len(prefixes))] if rng.random() < 0.9 else []
        prompt = shared + [rng.randrange(50000) for _ in range(128)]
        hashes = hash_full_blocks(prompt, BLOCK)  # the caller's work, not the router's
        start = time.perf_counter()
        router.assign(f"r{index}", hashes, len(prompt), BLOCK)
        seconds.append(time.perf_counter() - start)
        if index >= args.in_flight:
            router.release(f"r{index - args.in_flight}")
    ordered = sorted(seconds)
    print(json.dumps({
        "replicas": args.replicas, "directory_blocks": router.directory.num_blocks,
        "in_flight": args.in_flight, "build_s": round(built, 1),
        "decision_ms_p50": 1e3 * statistics.median(ordered),
        "decision_ms_p99": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
        "decisions": dict(router.decisions)}, indent=1))


if __name__ == "__main__":
    main()
