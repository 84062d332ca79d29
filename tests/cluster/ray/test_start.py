"""init_ray: a local Ray start whose raylet died in its first seconds is started again."""

import logging

import pytest

from cluster.ray import start

TIMED_OUT = Exception("The current node timed out during startup. This could happen because "
                      "some of the raylet failed to startup or the GCS has become overloaded.")


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init answering from a list (an exception is raised, anything else returns) and
    every call, init and shutdown, recorded in order."""
    import ray

    calls, answers = [], []

    def init(**kwargs):
        calls.append(("init", kwargs))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("shutdown", {})))
    return calls, answers


def test_a_start_that_timed_out_is_shut_down_and_started_again(fake_ray, caplog):
    calls, answers = fake_ray
    answers += [TIMED_OUT, None]
    with caplog.at_level(logging.WARNING, logger="cluster.ray.start"):
        start.init_ray(num_cpus=8, include_dashboard=False)
    assert calls == [("init", {"num_cpus": 8, "include_dashboard": False}), ("shutdown", {}),
                     ("init", {"num_cpus": 8, "include_dashboard": False})]
    assert caplog.messages == [f"Ray did not start ({TIMED_OUT}); starting it again "
                               "(attempt 2 of 3)"]


def test_the_third_timeout_is_raised(fake_ray):
    calls, answers = fake_ray
    answers += [TIMED_OUT, TIMED_OUT, TIMED_OUT, None]
    with pytest.raises(Exception, match="timed out during startup") as raised:
        start.init_ray()
    assert raised.value is TIMED_OUT
    assert [name for name, _ in calls] == ["init", "shutdown", "init", "shutdown", "init"]


def test_any_other_error_is_raised_at_once(fake_ray):
    calls, answers = fake_ray
    refused = ValueError("When connecting to an existing cluster, num_cpus and num_gpus must "
                         "not be provided.")
    answers += [refused, None]
    with pytest.raises(ValueError) as raised:
        start.init_ray(address="auto", num_cpus=2)
    assert raised.value is refused
    assert calls == [("init", {"address": "auto", "num_cpus": 2})]
