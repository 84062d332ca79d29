"""cluster/environment.py: the one module that reads or sets the environment, and the config
defaults that come from it."""

import pytest

from cluster import environment
from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import worker_config


def test_the_peer_memory_kernel_is_chosen_by_argument_or_environment(monkeypatch):
    monkeypatch.delenv(environment.PEER_SUM.name, raising=False)
    assert EngineConfig().peer_sum_kernel == "push"
    monkeypatch.setenv(environment.PEER_SUM.name, "one_shot")
    assert EngineConfig().peer_sum_kernel == "one_shot"
    assert EngineConfig(peer_sum_kernel="push").peer_sum_kernel == "push"  # an argument wins
    monkeypatch.setenv(environment.PEER_SUM.name, "ring")
    message = (r"the peer-memory sum kernel \(TANDEM_PEER_SUM\) must be one of push, one_shot, "
               "got 'ring'")
    with pytest.raises(ValueError, match=message):
        EngineConfig()


def test_the_kernel_and_cpu_threads_reach_the_workers_as_config(tmp_path):
    config = EngineConfig(peer_sum_kernel="one_shot", cpu_threads=3)
    worker = worker_config(config, tmp_path)
    assert (worker.peer_sum_kernel, worker.cpu_threads) == ("one_shot", 3)
    with pytest.raises(ValueError, match="cpu_threads must be at least 1, got 0"):
        EngineConfig(cpu_threads=0)


def test_a_bad_kernel_name_is_refused_before_any_device_work():
    import torch

    from workers.layers.symmetric_all_reduce import SymmetricAllReduce

    with pytest.raises(ValueError, match="the peer-memory sum kernel must be one of push, "
                                         "one_shot, got 'ring'"):
        SymmetricAllReduce(None, torch.device("cpu"), kernel="ring")  # type: ignore[arg-type]


def test_serve_runs_ray_serve_throughput_optimized_unless_told(monkeypatch):
    name = environment.SERVE_THROUGHPUT_OPTIMIZED.name
    monkeypatch.delenv(name, raising=False)
    assert environment.set_serve_throughput_optimized(None) == "1"
    assert (environment.set_serve_throughput_optimized(True),
            environment.set_serve_throughput_optimized(False)) == ("1", "0")
    monkeypatch.setenv(name, "0")  # the environment's choice, unless a flag
    assert (environment.set_serve_throughput_optimized(None),
            environment.set_serve_throughput_optimized(True)) == ("0", "1")
    import os

    assert os.environ[name] == "1"  # set for the Ray instance about to start


def test_the_cache_dir_comes_from_the_environment_when_a_config_is_made(monkeypatch, tmp_path):
    monkeypatch.setenv(environment.CACHE_DIR.name, str(tmp_path))
    config = EngineConfig()
    assert config.cache_dir == str(tmp_path)
    monkeypatch.delenv(environment.CACHE_DIR.name)
    assert config.cache_dir == str(tmp_path)  # read once, at the edge, then carried as config
    assert EngineConfig().cache_dir.endswith(".cache/tandem")
