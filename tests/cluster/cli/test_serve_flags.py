"""`tandem serve`'s flags, vLLM's names and meanings: each one reaches the engine's config;
a bad value is refused with the flag's name, never ignored."""

import json

import pytest

from cluster.cli.main import build_parser
from cluster.cli.serve import check_ports_free, keeps_ray_on_loopback, serve_config
from cluster.cli.serve_ports import serve_ports
from cluster.ray.serving_policy import ServingPolicy
from workers.speculative.config import SpeculativeConfig


def config_of(*flags):
    return serve_config(build_parser().parse_args(["serve", *flags]))


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--tp", "2"], "tensor_parallel_size", 2),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--max-num-seqs", "16"], "max_num_seqs", 16),
    (["--max-num-batched-tokens", "512"], "max_num_batched_tokens", 512),
    (["--max-model-len", "2048"], "max_model_len", 2048),
    (["--block-size", "32"], "block_size", 32),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--seed", "7"], "seed", 7),
    (["--enable-chunked-prefill"], "enable_chunked_prefill", True),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096", "--max-model-len",
      "4096"], "enable_chunked_prefill", False),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--no-prefix-caching"], "enable_prefix_caching", False),
    (["--scheduler-delay-factor", "0.5"], "scheduler_delay_factor", 0.5),
    (["--tpot-target-ms", "25"], "tpot_target_ms", 25.0),
    (["--async-scheduling"], "async_scheduling", True),
    ([], "async_scheduling", None),
    (["--no-async-scheduling"], "async_scheduling", False),
    (["--kv-cache-dtype", "int8"], "kv_cache_dtype", "int8"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    ([], "kv_cache_dtype", "auto"),
    (["--host-kv-cache-gb", "4"], "host_kv_cache_gb", 4.0),
    (["--host-kv-cache-gb", "4", "--disk-kv-cache-dir", "/data/kv"], "disk_kv_cache_dir",
     "/data/kv"),
    (["--disk-kv-cache-gb", "100"], "disk_kv_cache_gb", 100.0),
])
def test_each_flag_reaches_the_engine_config(flags, field, value):
    assert getattr(config_of(*flags).engine_config(), field) == value


def test_the_serving_flags_and_the_model_first():
    config = config_of("smollm2-135m-instruct", "--served-model-name", "smol", "--api-key", "k",
                       "--host", "0.0.0.0", "--port", "9000")
    assert (config.model, config.model_name, config.api_key, config.host, config.port) == (
        "smollm2-135m-instruct", "smol", "k", "0.0.0.0", 9000)
    assert config_of("--model", "m").model == config_of("m").model == "m"
    with pytest.raises(ValueError, match="two models given: 'a' and --model 'b'"):
        config_of("a", "--model", "b")


def test_the_brief_s_command_line_is_accepted():
    config = config_of("smollm2-135m-instruct", "--max-num-seqs", "16",
                       "--max-num-batched-tokens", "512", "--enable-chunked-prefill",
                       "--max-model-len", "2048", "--tensor-parallel-size", "1",
                       "--scheduler-delay-factor", "0.5").engine_config()
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
            config.enable_chunked_prefill, config.scheduler_delay_factor) == (
        16, 512, 2048, True, 0.5)


def test_a_kv_cache_dtype_that_does_not_exist_is_refused_by_its_flag():
    with pytest.raises(ValueError) as error:
        config_of("--kv-cache-dtype", "int4")
    assert str(error.value) == ("invalid server configuration:\n"
                                "  --kv-cache-dtype: Input should be 'auto', 'int8' or 'fp8'")


def test_speculative_flags_reach_the_engine_config():
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert config_of("--speculative-config", json.dumps(ngram)).engine_config().speculation == (
        SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    older = config_of("--speculative-model", "[ngram]", "--num-speculative-tokens", "5")
    assert older.engine_config().speculative_config == {"method": "ngram",
                                                        "num_speculative_tokens": 5}
    assert config_of().engine_config().speculation is None
    drafted = config_of("--speculative-model", "qwen2.5-coder-0.5b-instruct",
                        "--num-speculative-tokens", "3").engine_config()
    assert drafted.speculation == SpeculativeConfig(
        method="draft_model", model="qwen2.5-coder-0.5b-instruct", num_speculative_tokens=3)
    assert drafted.resolved_decode_steps == 1  # the draft follows every step


@pytest.mark.parametrize(("flags", "message"), [
    (["--speculative-config", "{method: ngram}"],
     "--speculative-config: not JSON (Expecting property name enclosed in double quotes)"),
    (["--speculative-config", "[1]"], "--speculative-config: give a JSON object"),
    (["--speculative-config", '{"num_speculative_tokens": 4}', "--num-speculative-tokens", "2"],
     "--num-speculative-tokens 2 contradicts --speculative-config's 'num_speculative_tokens'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "--speculative-config: num_speculative_tokens must be in [1, 8], got 0"),
    (["--speculative-model", "qwen2.5-coder-0.5b-instruct",
      "--speculative-draft-tensor-parallel-size", "2"],
     "--speculative-config: draft_tensor_parallel_size above 1 is not built yet (a draft "
     "runs on one device, in the worker or in its actor), got 2"),
    (["--speculative-config", '{"model": "m", "placement": "actor", "draft_gpus": 2}'],
     "--speculative-config: draft_gpus must be in (0, 1] (a GPU or a share of one), got 2"),
])
def test_bad_speculative_flags_are_refused_with_the_reason(flags, message):
    with pytest.raises(ValueError) as error:
        config_of(*flags)
    assert str(error.value) == message


def test_without_chunked_prefill_the_context_must_fit_one_step():
    with pytest.raises(ValueError, match=r"with enable_chunked_prefill=False, max_model_len "
                                         r"\(2048\) must be at most max_num_batched_tokens "
                                         r"\(512\)"):
        config_of("--no-enable-chunked-prefill", "--max-model-len", "2048",
                  "--max-num-batched-tokens", "512").engine_config()


@pytest.mark.parametrize(("flags", "message"), [
    (["--host-kv-cache-gb", "-1"], "invalid server configuration:\n  --host-kv-cache-gb: Input "
     "should be greater than or equal to 0"),
    (["--disk-kv-cache-gb", "0"], "invalid server configuration:\n  --disk-kv-cache-gb: Input "
     "should be greater than 0"),
    (["--disk-kv-cache-dir", ""], "invalid server configuration:\n  --disk-kv-cache-dir: String "
     "should have at least 1 character"),
])
def test_bad_kv_tier_flags_are_refused_by_name(flags, message):
    with pytest.raises(ValueError) as error:
        config_of(*flags)
    assert str(error.value) == message


def test_a_disk_tier_without_a_host_tier_is_refused_with_the_reason():
    with pytest.raises(ValueError) as error:
        config_of("--disk-kv-cache-dir", "/data/kv").engine_config()
    assert str(error.value) == ("disk_kv_cache_dir needs host_kv_cache_gb > 0: blocks reach the "
                                "disk tier through the host tier")


def test_the_overload_and_fault_flags_reach_the_serving_policy():
    config = config_of("--max-waiting-requests", "8", "--max-waiting-tokens", "4096",
                       "--retry-after", "5", "--failover-timeout", "12",
                       "--health-check-period", "0.5", "--request-timeout", "60",
                       "--drain-timeout", "10", "--replica-start-timeout", "90")
    assert config.serving_policy() == ServingPolicy(
        max_waiting_requests=8, max_waiting_tokens=4096, retry_after_s=5,
        failover_timeout_s=12.0, health_check_period_s=0.5, replica_start_timeout_s=90.0)
    assert (config.request_timeout, config.drain_timeout) == (60.0, 10.0)
    defaults = config_of()
    assert defaults.serving_policy() == ServingPolicy()  # no limits, 2 s, 30 s, 1 s, 600 s
    assert (defaults.request_timeout, defaults.drain_timeout) == (0.0, 30.0)
    with pytest.raises(ValueError, match="--retry-after: Input should be greater than or "
                                         "equal to 1"):
        config_of("--retry-after", "0")


@pytest.mark.parametrize(("throughput", "ingress", "http", "proxy", "grpc"), [
    (True, 1, (8000,), 8001, range(8002, 8003)),
    (True, 4, (8000, 8001, 8002, 8003), 8004, range(8005, 8009)),
    (False, 4, (8000,), 8000, range(0)),  # the proxy alone
])
def test_every_port_follows_from_the_port_flag(throughput, ingress, http, proxy, grpc):
    ports = serve_ports(8000, ingress, throughput)
    assert (ports.http, ports.proxy, ports.grpc) == (http, proxy, grpc)


def test_a_port_range_past_65535_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--port 65535 leaves no room for ports up to 65537"):
        check_ports_free("127.0.0.1", serve_ports(65535, 1, True))


def test_device_help_says_what_is_accepted_and_the_rest_is_refused_by_its_flag(monkeypatch,
                                                                               capsys):
    monkeypatch.setenv("COLUMNS", "400")  # one line a flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    [line] = [line for line in capsys.readouterr().out.splitlines()
              if line.strip().startswith("--device")]
    assert line.split(None, 2)[2] == ("auto (default: cuda when present, else cpu) | cpu | cuda "
                                      "| cuda:N (the same as cuda: Ray gives each shard a GPU of "
                                      "its own)")
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert config_of("--device", device).engine_config().device == device
    for device in ("gpu", "cuda:", "cuda:x", "mps"):
        with pytest.raises(ValueError) as error:
            config_of("--device", device)
        assert str(error.value) == ("invalid server configuration:\n"
                                    "  --device: Input should be 'auto', 'cpu', 'cuda' or 'cuda:N'")


@pytest.mark.parametrize(("host", "ray_address", "ray_started", "on_loopback"), [
    ("127.0.0.1", None, False, True),
    ("localhost", None, False, True),
    ("::1", "local", False, True),
    ("0.0.0.0", None, False, False),  # every interface: Ray as it was
    ("10.1.2.3", None, False, False),
    ("127.0.0.1", "auto", False, False),  # a running cluster's nodes must reach each other
    ("127.0.0.1", "10.1.2.3:6379", False, False),
    ("127.0.0.1", None, True, False),  # `ray start` left its address: ray.init() joins it
])
def test_a_local_ray_keeps_to_the_loopback_address_when_serving_on_one(
        monkeypatch, tmp_path, host, ray_address, ray_started, on_loopback):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    if ray_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    if ray_started:
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text("10.1.2.3:6379")
    assert keeps_ray_on_loopback(host) is on_loopback


def test_the_briefs_flags_take_an_eagle_head_folder(tmp_path):
    from tests.eagle_heads import write_head

    write_head(tmp_path / "head", "eagle3")
    served = config_of("--speculative-model", str(tmp_path / "head"),
                       "--num-speculative-tokens", "5").engine_config()
    assert served.speculation == SpeculativeConfig(method="eagle3", model=str(tmp_path / "head"),
                                                   num_speculative_tokens=5)
