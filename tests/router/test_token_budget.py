"""The step's token budget for a TPOT target: the most tokens a step takes within the target
by the measured step cost, bounded by a floor and the configured budget; exact budgets and
the scheduler's steps under it."""

import pytest

from kvstore.kv_cache_manager import KVCacheManager
from router.sampling_params import SamplingParams
from router.scheduler import Scheduler, SchedulerConfig
from router.sequence import Sequence
from router.token_budget import TokenBudget


def test_the_budget_is_the_tokens_a_step_takes_within_the_target():
    budget = TokenBudget(target_ms=25.0, ceiling=8192)
    assert budget.budget(num_decodes=10) == 8192  # nothing measured yet
    for tokens in (64, 512, 2048, 4096):  # 5 ms a step and 5 ms a thousand tokens
        budget.observe(1, tokens, 0.005 + 0.005 * tokens / 1000)
    assert budget.budget(num_decodes=10) == 4000
    budget.observe(8, 64, 1.0)  # a multi-step call: not a step's cost
    assert budget.budget(num_decodes=10) == 4000


def test_the_budget_stays_between_its_floor_and_the_configured_budget():
    slow = TokenBudget(target_ms=10.0, ceiling=2048)
    for tokens in (100, 1000, 2000):  # 20 ms before any token: no step makes the target
        slow.observe(1, tokens, 0.020 + 0.001 * tokens / 1000)
    assert slow.budget(num_decodes=10) == 2048 // 8  # a prefill still moves
    assert slow.budget(num_decodes=300) == 301  # every decode and one prompt token
    fast = TokenBudget(target_ms=100.0, ceiling=2048)
    for tokens in (100, 1000, 2000):
        fast.observe(1, tokens, 0.001 + 0.001 * tokens / 1000)
    assert fast.budget(num_decodes=10) == 2048
    off = TokenBudget(target_ms=0.0, ceiling=2048)
    off.observe(1, 1000, 10.0)
    assert off.budget(num_decodes=10) == 2048
    with pytest.raises(ValueError, match=r"tpot_target_ms must be >= 0 \(0: off\), got -1"):
        TokenBudget(target_ms=-1.0, ceiling=2048)


def test_the_scheduler_chunks_prompts_to_the_measured_budget():
    config = SchedulerConfig(4096, max_num_batched_tokens=1024, max_num_seqs=8,
                             tpot_target_ms=10.0)
    sched = Scheduler(config, KVCacheManager(512, 16))
    for tokens in (100, 400, 800):  # 2 ms a step and 20 ms a thousand tokens: 400 tokens
        sched.token_budget.observe(1, tokens, 0.002 + 0.020 * tokens / 1000)
    sched.add(Sequence("a", list(range(1000)), SamplingParams(max_tokens=4)))
    output = sched.schedule()
    assert [(item.seq.request_id, item.num_new_tokens) for item in output.scheduled] == [
        ("a", 400)]
