"""Engine autoscaling from `tandem serve` flags and a Serve config's `autoscaling` section: the
policy that reaches the cluster, the count it starts with, and bad values named."""

import pytest

from cluster.cli.main import build_parser
from cluster.cli.serve import serve_config
from cluster.serve.config import load_config
from router.autoscale import AutoscalingPolicy


def config_of(*flags):
    return serve_config(build_parser().parse_args(["serve", *flags]))


def test_no_flag_no_autoscaling():
    config = config_of("--replicas", "2")
    assert config.autoscaling is None and config.initial_replicas == 2


def test_the_bounds_and_the_json_make_the_policy():
    config = config_of("--min-replicas", "2", "--max-replicas", "6", "--autoscaling-config",
                       '{"target_running_seqs": 32, "downscale_delay_s": 300}')
    assert config.autoscaling == AutoscalingPolicy(min_replicas=2, max_replicas=6,
                                                   target_running_seqs=32,
                                                   downscale_delay_s=300)
    assert config.initial_replicas == 2  # no --replicas: start at the minimum
    assert config_of("--max-replicas", "4", "--replicas", "3").initial_replicas == 3


@pytest.mark.parametrize(("flags", "message"), [
    (["--autoscaling-config", "{"], "--autoscaling-config: not JSON"),
    (["--autoscaling-config", "[1]"], "--autoscaling-config: give a JSON object"),
    (["--max-replicas", "3", "--autoscaling-config", '{"max_replicas": 4}'],
     "--max-replicas 3 contradicts --autoscaling-config's 'max_replicas'"),
    (["--max-replicas", "4", "--replicas", "5"],
     r"num_replicas \(5\) is the count autoscaling starts with: give one in "
     r"min_replicas..max_replicas \(1..4\)"),
    (["--min-replicas", "3", "--max-replicas", "2"],
     r"autoscaling: .*max_replicas \(2\) must be at least min_replicas \(3\)"),
    (["--autoscaling-config", '{"target_running": 3}'],
     "autoscaling.target_running: Unexpected keyword argument"),
])
def test_bad_autoscaling_is_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        config_of(*flags)


def test_a_serve_config_files_section():
    config = load_config({"num_replicas": 1, "autoscaling": {
        "min_replicas": 1, "max_replicas": 8, "target_waiting_prompt_tokens": 8192,
        "target_ttft_p90_s": 1.5, "upscale_delay_s": 15}})
    assert config.autoscaling is not None
    assert (config.autoscaling.max_replicas, config.autoscaling.target_ttft_p90_s,
            config.autoscaling.upscale_delay_s, config.initial_replicas) == (8, 1.5, 15, 1)
    with pytest.raises(ValueError, match=r"autoscaling.min_replicas: Input should be a valid "
                                         "integer"):
        load_config({"autoscaling": {"min_replicas": "many"}})
