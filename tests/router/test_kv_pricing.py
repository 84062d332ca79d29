"""Pricing copies against recomputes, and the router's three choices for a prefix held on a
busy replica: route there, pull its blocks to another, or recompute; exact decisions, with the
holder's blocks in its device cache, its host tier, or both."""

from dataclasses import replace

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import EventBatch, KVDirectory
from kvstore.events import HOST, BlockStored
from router.kv_pricing import (
    PullChoice,
    TransferRates,
    cheapest_pull,
    cluster_rates,
    load_tokens,
    swap_pays,
)
from router.placement import PrefixAffinity, ReplicaLoad, RoutingRequest

BS = 4
# 1,000 prompt tokens a second; a block of 1,000 bytes copies in 1 ms, pulls in 2 ms more
RATES = TransferRates(prefill_tokens_per_s=1000.0, host_copy_bytes_per_s=1e6,
                      block_bytes=1000, pull_bytes_per_s=5e5)


def test_seconds_of_each_way_follow_the_measured_rates():
    assert RATES.recompute_seconds(500) == 0.5
    assert RATES.load_seconds(3) == pytest.approx(0.003)
    assert RATES.pull_seconds(3) == pytest.approx(0.009)  # 6 ms through the store, 3 to load
    # loads measured slower than their copy (a start-up probe, the live rates): priced so
    dear = replace(RATES, load_bytes_per_s=2.5e5)
    assert dear.load_seconds(3) == pytest.approx(0.012)
    assert dear.pull_seconds(3) == pytest.approx(0.018)
    assert replace(RATES, load_bytes_per_s=1e9).load_seconds(3) == pytest.approx(0.003)
    assert RATES.in_tokens(0.009) == pytest.approx(9.0)


def test_swap_only_when_copying_out_and_back_beats_recomputing():
    # 4 blocks: 1 copied out + 4 back = 5 ms, against 16 tokens = 16 ms
    assert swap_pays(RATES, 1, 4, 16)
    slow = TransferRates(1000.0, 1e4, 1000)  # 100 ms a block
    assert not swap_pays(slow, 1, 4, 16)  # 500 ms against 16 ms: recompute
    assert not swap_pays(slow, 0, 4, 16)  # loading alone too
    assert swap_pays(None, 1, 4, 16)  # nothing measured: swap, the copies run beside steps


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="measured rates must be positive"):
        TransferRates(0.0, 1e6, 1000)
    with pytest.raises(ValueError, match="bad block size, pull rate or store cost"):
        TransferRates(1000.0, 1e6, 1000, pull_bytes_per_s=-1.0)


def test_the_cluster_prices_pulls_with_its_slowest_serving_replica():
    asked = []

    def store_rate() -> float:
        asked.append(1)
        return 5e5

    fast = TransferRates(2000.0, 1e6, 1000)
    slow_copy = TransferRates(3000.0, 2e5, 1000)
    assert cluster_rates([fast, slow_copy], store_rate) == TransferRates(2000.0, 2e5, 1000, 5e5)
    probed = replace(fast, load_bytes_per_s=1e5)  # its start-up probe's loads
    assert cluster_rates([probed, slow_copy], store_rate).load_bytes_per_s == 1e5
    # one replica, or one without a host tier: nothing to pull, the store not even measured
    assert cluster_rates([fast], store_rate) is None
    assert cluster_rates([fast, None], store_rate) is None
    assert cluster_rates([], store_rate) is None
    assert len(asked) == 2


def test_the_cheapest_pull_goes_to_the_replica_that_saves_most():
    # replica 0's host tier lists 10 blocks; 1 and 2 none; 2 is cheaper to run on
    costs = {0: 500.0, 1: 300.0, 2: 200.0}
    matched = {0: 10, 1: 0, 2: 0}
    runs = {0: {0: 10, 1: 0, 2: 0}, 10: {0: 0, 1: 0, 2: 0}}
    pull = cheapest_pull(RATES, costs, matched, runs.__getitem__, max_blocks=8, block_size=BS)
    # 8 blocks (the prompt's last token is computed): 200 - 32 + 8 x 3 ms x 1000 tok/s
    assert pull == PullChoice(2, 0, 0, 8, pytest.approx(200 - 32 + 24))
    assert cheapest_pull(None, costs, matched, runs.__getitem__, 8, BS) is None
    no_pulls = TransferRates(1000.0, 1e6, 1000)  # no pull rate measured
    assert cheapest_pull(no_pulls, costs, matched, runs.__getitem__, 8, BS) is None


def test_a_pull_starts_where_the_target_stops_and_takes_the_longest_host_run():
    # 1 holds blocks 0-1; from block 2 on, 0's host tier lists 1 block and 2's lists 3
    costs, matched = {1: 100.0}, {1: 2}
    asked = []

    def host_runs(first):
        asked.append(first)
        return {0: 1, 1: 0, 2: 3}

    pull = cheapest_pull(RATES, costs, matched, host_runs, max_blocks=4, block_size=BS)
    # only 2 of 2's 3 blocks are within the prompt's 4: 100 - 8 + 2 x 3
    assert pull == PullChoice(1, 2, 2, 2, pytest.approx(98.0)) and asked == [2]
    assert cheapest_pull(RATES, costs, matched, lambda first: {0: 0, 1: 4, 2: 0}, 4,
                         BS) is None  # its own host blocks are no pull


def test_a_load_from_the_own_host_tier_costs_its_copies():
    assert load_tokens(RATES, 4) == pytest.approx(4.0)  # 4 blocks of 1 ms
    assert load_tokens(None, 4) == 0.0  # unmeasured: a load is taken to beat recomputing


PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks, then the one computed
HASHES = hash_full_blocks(PROMPT, BS)


def policy_with(holdings, rates, num_replicas=2):
    """``holdings``: per replica, (its device blocks, its host-tier blocks) of the prompt, by
    block index."""
    directory = KVDirectory(num_replicas)
    for replica, (device, host) in holdings.items():
        events = (*(BlockStored(HASHES[i], HASHES[i - 1] if i else None) for i in device),
                  *(BlockStored(HASHES[i], None, HOST) for i in host))
        directory.apply(EventBatch(replica, "epoch", 0, events))
    policy = PrefixAffinity(directory, pending_seconds=0.0)
    policy.set_rates(rates)
    return policy, RoutingRequest(HASHES, len(PROMPT), BS)


ALL = range(4)
WRITTEN_THROUGH = {0: (ALL, ALL)}  # replica 0's device cache and host tier hold the prompt
HOST_ONLY = {0: ((), ALL)}  # its device cache lost them; its host tier kept them
DEVICE_ONLY = {0: (ALL, ())}  # never written to its host tier (or evicted from there)
IDLE, BUSY = [ReplicaLoad(), ReplicaLoad()], [ReplicaLoad(num_requests=1), ReplicaLoad()]


def choice(policy, request, loads):
    decision = policy.choose(loads, request)
    return decision.replica, decision.reason, decision.cached_tokens, decision.pull


def test_an_idle_holder_gets_the_request_and_a_busy_one_is_pulled_from():
    policy, request = policy_with(WRITTEN_THROUGH, RATES)
    assert choice(policy, request, IDLE) == (0, "affinity", 16, None)
    # replica 0 decodes one request (32 tokens' worth): pulling 4 blocks to 1 costs
    # 17 - 16 + 12 ms x 1000 tok/s = 13, against 33 there and 17 recomputing on 1
    assert choice(policy, request, BUSY) == (1, "pull", 16,
                                             PullChoice(1, 0, 0, 4, pytest.approx(13.0)))


def test_host_only_blocks_send_the_request_to_their_holder_or_are_pulled_from_it():
    policy, request = policy_with(HOST_ONLY, RATES)
    # 17 - 16 + 4 loads of 1 ms = 5 there, against 17 recomputing on 1 (or 13 pulling)
    assert choice(policy, request, IDLE) == (0, "affinity", 16, None)
    # busy: 37 there; the pull to 1 costs 13 as from a written-through holder
    assert choice(policy, request, BUSY) == (1, "pull", 16,
                                             PullChoice(1, 0, 0, 4, pytest.approx(13.0)))


def test_host_only_blocks_slower_to_load_than_to_recompute_are_recomputed_elsewhere():
    slow_copies = TransferRates(1000.0, 1e5, 1000, pull_bytes_per_s=5e5)  # 10 ms a load
    policy, request = policy_with(HOST_ONLY, slow_copies)
    # there 17 - 16 + 40 = 41, a pull 17 - 16 + 4 x 12 = 49: recompute all 17 on 1
    assert choice(policy, request, IDLE) == (1, "no_match", 0, None)


def test_device_blocks_never_written_to_a_host_tier_are_not_pulled():
    policy, request = policy_with(DEVICE_ONLY, RATES)
    assert choice(policy, request, IDLE) == (0, "affinity", 16, None)
    assert choice(policy, request, BUSY) == (1, "no_match", 0, None)


def test_a_prefix_on_device_then_in_host_loads_only_the_host_blocks():
    # 0 lost blocks 2-3 from its device cache; 1 holds blocks 0-1 on device, nothing in host
    policy, request = policy_with({0: ((0, 1), ALL), 1: ((0, 1), ())}, RATES)
    # idle: 17 - 16 + 2 loads = 3 on 0, 17 - 8 = 9 on 1 (or 9 - 8 + 2 x 3 = 7 pulling)
    assert choice(policy, request, IDLE) == (0, "affinity", 16, None)
    # 0 busy (35): 1 pulls blocks 2-3 from 0's host tier
    assert choice(policy, request, BUSY) == (1, "pull", 16,
                                             PullChoice(1, 0, 2, 2, pytest.approx(7.0)))


def test_the_pull_comes_from_the_longest_host_run():
    policy, request = policy_with({0: ((), (0, 1)), 1: ((), ALL)}, RATES, num_replicas=3)
    busy = [ReplicaLoad(num_requests=1), ReplicaLoad(num_requests=1), ReplicaLoad()]
    assert choice(policy, request, busy) == (2, "pull", 16,
                                             PullChoice(2, 1, 0, 4, pytest.approx(13.0)))


def test_a_pull_slower_than_the_recompute_is_not_taken():
    slow = TransferRates(1000.0, 1e6, 1000, pull_bytes_per_s=1e5)  # 10 ms a block: 44 tokens
    policy, request = policy_with(WRITTEN_THROUGH, slow)
    assert choice(policy, request, BUSY) == (1, "no_match", 0, None)


def test_without_rates_nothing_is_pulled_and_host_blocks_load_for_free():
    policy, request = policy_with(WRITTEN_THROUGH, None)
    assert choice(policy, request, BUSY) == (1, "no_match", 0, None)
    policy, request = policy_with(HOST_ONLY, None)
    assert choice(policy, request, IDLE) == (0, "affinity", 16, None)


def test_under_the_load_guard_the_least_loaded_replica_pulls_from_the_holder():
    policy, request = policy_with(WRITTEN_THROUGH, RATES)
    policy.max_imbalance = 1
    # replica 0 holds the prefix with 3 requests in flight, 2 of them decoding (cost 65):
    # the guard sends the request to 1, which pulls rather than recompute (13 against 17)
    loads = [ReplicaLoad(num_requests=3, num_prefilling=1), ReplicaLoad()]
    assert choice(policy, request, loads) == (1, "pull", 16,
                                              PullChoice(1, 0, 0, 4, pytest.approx(13.0)))
