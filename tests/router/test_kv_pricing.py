"""Pricing copies against recomputes, and the router's three choices for a prefix held on a
busy replica: route there, pull its blocks to another, or recompute; exact decisions."""

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import EventBatch, KVDirectory
from kvstore.events import BlockStored
from router.kv_pricing import PullChoice, TransferRates, cheapest_pull, swap_pays
from router.placement import PrefixAffinity, ReplicaLoad, RoutingRequest

BS = 4
# 1,000 prompt tokens a second; a block of 1,000 bytes copies in 1 ms, pulls in 2 ms more
RATES = TransferRates(prefill_tokens_per_s=1000.0, host_copy_bytes_per_s=1e6,
                      block_bytes=1000, pull_bytes_per_s=5e5)


def test_seconds_of_each_way_follow_the_measured_rates():
    assert RATES.recompute_seconds(500) == 0.5
    assert RATES.copy_seconds(3) == pytest.approx(0.003)
    assert RATES.pull_seconds(3) == pytest.approx(0.009)  # 6 ms through the store, 3 to load
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
    with pytest.raises(ValueError, match="bad block size or pull rate"):
        TransferRates(1000.0, 1e6, 1000, pull_bytes_per_s=-1.0)


def test_the_cheapest_pull_goes_to_the_replica_that_saves_most():
    # replica 0 holds 10 blocks; 1 and 2 none; 2 is cheaper to run on
    costs = {0: 500.0, 1: 300.0, 2: 200.0}
    stored, matched = {0: 10, 1: 0, 2: 0}, {0: 10, 1: 0, 2: 0}
    pull = cheapest_pull(RATES, costs, stored, matched, max_blocks=8, block_size=BS)
    # 8 blocks (the prompt's last token is computed): 200 - 32 + 8 x 3 ms x 1000 tok/s
    assert pull == PullChoice(2, 0, 0, 8, pytest.approx(200 - 32 + 24))
    assert cheapest_pull(None, costs, stored, matched, 8, BS) is None
    no_pulls = TransferRates(1000.0, 1e6, 1000)  # no pull rate measured
    assert cheapest_pull(no_pulls, costs, stored, matched, 8, BS) is None


def policy_with(held_blocks, rates):
    directory = KVDirectory(2)
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks, then the one computed
    hashes = hash_full_blocks(prompt, BS)
    events = tuple(BlockStored(h, hashes[i - 1] if i else None)
                   for i, h in enumerate(hashes[:held_blocks]))
    directory.apply(EventBatch(0, "epoch", 0, events))
    policy = PrefixAffinity(directory, pending_seconds=0.0)
    policy.set_rates(rates)
    return policy, RoutingRequest(hashes, len(prompt), BS)


def test_an_idle_holder_gets_the_request_and_a_busy_one_is_pulled_from():
    policy, request = policy_with(4, RATES)
    idle = [ReplicaLoad(), ReplicaLoad()]
    decision = policy.choose(idle, request)
    assert (decision.replica, decision.reason, decision.pull) == (0, "affinity", None)
    # replica 0 decodes one request (32 tokens' worth): pulling 4 blocks to 1 costs
    # 17 - 16 + 12 ms x 1000 tok/s = 13, against 33 there and 17 recomputing on 1
    busy = [ReplicaLoad(num_requests=1), ReplicaLoad()]
    decision = policy.choose(busy, request)
    assert (decision.replica, decision.reason, decision.cached_tokens) == (1, "pull", 16)
    assert decision.pull == PullChoice(1, 0, 0, 4, pytest.approx(13.0))


def test_a_pull_slower_than_the_recompute_is_not_taken():
    slow = TransferRates(1000.0, 1e6, 1000, pull_bytes_per_s=1e5)  # 10 ms a block: 44 tokens
    policy, request = policy_with(4, slow)
    decision = policy.choose([ReplicaLoad(num_requests=1), ReplicaLoad()], request)
    assert (decision.replica, decision.reason, decision.pull) == (1, "no_match", None)


def test_without_rates_nothing_is_pulled():
    policy, request = policy_with(4, None)
    decision = policy.choose([ReplicaLoad(num_requests=1), ReplicaLoad()], request)
    assert (decision.replica, decision.reason, decision.pull) == (1, "no_match", None)


def test_under_the_load_guard_the_least_loaded_replica_pulls_from_the_holder():
    policy, request = policy_with(4, RATES)
    policy.max_imbalance = 1
    # replica 0 holds the prefix with 3 requests in flight, 2 of them decoding (cost 65):
    # the guard sends the request to 1, which pulls rather than recompute (13 against 17)
    decision = policy.choose([ReplicaLoad(num_requests=3, num_prefilling=1), ReplicaLoad()],
                             request)
    assert (decision.replica, decision.reason) == (1, "pull")
    assert decision.pull == PullChoice(1, 0, 0, 4, pytest.approx(13.0))
