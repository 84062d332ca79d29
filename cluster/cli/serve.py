"""`tandem serve`: start a local Ray cluster and serve the OpenAI-compatible API on it.

Flags left out take ``ServeConfig``'s defaults; pydantic checks the rest and every problem
is reported at once, one line per flag.
"""

import argparse
import ipaddress
import json
import signal
import socket
import time

from cluster import environment
from cluster.cli.autoscaling_flags import add_autoscaling_flags, autoscaling_config
from cluster.cli.drain import ShutdownRequested, drain_and_stop, raise_on_signals, stop_serve
from cluster.cli.serve_ports import ServePorts, serve_ports
from cluster.engine.config import DEFAULT_MODEL
from cluster.ray.start import init_ray
from cluster.serve.config import ServeConfig, load_config
from workers.speculative.config import SpeculativeConfig

# ServeConfig field -> (flags, the first is vLLM's where vLLM has one; type; help)
FLAGS: dict[str, tuple[tuple[str, ...], type, str]] = {
    "model": (("--model",), str, f"catalog name or HF folder (default: {DEFAULT_MODEL}); "
              "or give it first, as `tandem serve MODEL`"),
    "served_model_name": (("--served-model-name",), str, "the name clients send as `model`"),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp", "--tp"), int,
                             "tensor-parallel GPUs per replica (default: 1)"),
    "num_replicas": (("--replicas",), int, "engine replicas (default: 1)"),
    "ingress_replicas": (("--ingress-replicas",), int,
                         "HTTP ingress replicas (default: 0, auto: 4 on a GPU, 1 on the CPU)"),
    "host": (("--host",), str, "bind address (default: 127.0.0.1)"),
    "port": (("--port",), int, "HTTP port (default: 8000); ingress replica i takes port + i, "
             "Serve's proxy port + n (docs/serving.md: Ports)"),
    "api_key": (("--api-key",), str, "require this bearer key on /v1 (default: "
                f"${environment.API_KEY.name})"),
    "max_body_bytes": (("--max-body-bytes",), int, "larger request bodies get 413 (4 MiB)"),
    "dtype": (("--dtype",), str, "auto | float32 | bfloat16 | float16"),
    "kv_cache_dtype": (("--kv-cache-dtype",), str, "auto (as --dtype) | int8 | fp8 (e4m3, "
                       "GPUs of compute capability 8.9+): about twice the KV blocks"),
    "device": (("--device",), str, "auto (default: cuda when present, else cpu) | cpu | cuda | "
               "cuda:N (the same as cuda: Ray gives each shard a GPU of its own)"),
    "gpu_memory_utilization": (("--gpu-memory-utilization",), float,
                               "share of the GPU's memory each engine takes (default: 0.9)"),
    "max_model_len": (("--max-model-len",), int, "context length (default: the model's)"),
    "num_kv_blocks": (("--num-kv-blocks",), int, "KV blocks per replica (default: from memory)"),
    "block_size": (("--block-size",), int, "tokens per KV block (default: 16)"),
    "max_num_seqs": (("--max-num-seqs",), int, "sequences per batch at most (default: 64)"),
    "max_num_batched_tokens": (("--max-num-batched-tokens",), int,
                               "tokens per step at most (default: 2048)"),
    "scheduler_delay_factor": (("--scheduler-delay-factor",), float,
                               "new prompts wait this many times the last step while others "
                               "run, so more of them batch (default: 0, off)"),
    "tpot_target_ms": (("--tpot-target-ms",), float,
                       "a step's token budget from its measured cost: the most tokens (up to "
                       "--max-num-batched-tokens) within this time (default: 0, fixed)"),
    "decode_steps": (("--decode-steps",), int, "decode steps per worker call (default: 0, auto)"),
    "seed": (("--seed",), int, "engine seed (default: 0)"),
    "host_kv_cache_gb": (("--host-kv-cache-gb",), float, "host memory per replica for "
                         "offloaded KV blocks, in GiB (default: 0, off)"),
    "disk_kv_cache_dir": (("--disk-kv-cache-dir",), str, "a directory for KV blocks leaving "
                          "the host tier, shareable by replicas (default: none)"),
    "disk_kv_cache_gb": (("--disk-kv-cache-gb",), float, "size bound of the disk tier, in GiB "
                         "(default: 10)"),
    "routing": (("--routing",), str, "prefix-affinity (default) | least-loaded | round-robin"),
    "max_waiting_requests": (("--max-waiting-requests",), int,
                             "per replica, requests without a first token; past it everywhere "
                             "a new request gets 503 + Retry-After (default: 0, no limit)"),
    "max_waiting_tokens": (("--max-waiting-tokens",), int,
                           "per replica, those requests' prompt tokens; the same 503 past it "
                           "(default: 0, no limit)"),
    "retry_after": (("--retry-after",), int, "seconds a 503's Retry-After asks for (default: 2)"),
    "request_timeout": (("--request-timeout",), float,
                        "seconds a request may take, then 504; a client's X-Request-Timeout "
                        "header may ask for less (default: 0, no limit)"),
    "failover_timeout": (("--failover-timeout",), float,
                         "seconds a request whose replica was lost looks for another "
                         "(default: 30)"),
    "health_check_period": (("--health-check-period",), float,
                            "seconds between pings of every replica and shard (default: 1)"),
    "replica_start_timeout": (("--replica-start-timeout",), float,
                              "seconds an engine replica may take to come up (a node for its "
                              "shards, its weights), then an error (default: 600)"),
    "drain_timeout": (("--drain-timeout",), float,
                      "on SIGTERM or Ctrl-C, seconds in-flight requests get to finish "
                      "(default: 30)"),
}
SWITCHES = {  # ServeConfig field -> (flag, help): --flag / --no-flag
    "enable_chunked_prefill": ("--enable-chunked-prefill", "prefill prompts in chunks mixed "
                               "with decodes (default: on)"),
    "enable_prefix_caching": ("--enable-prefix-caching", "share the KV blocks of common "
                              "prefixes (default: on)"),
    "decode_lookahead": ("--decode-lookahead", "multi-step calls also run the next call's first "
                         "step (default: off for serving)"),
    "async_scheduling": ("--async-scheduling", "schedule each step while the workers run the "
                         "one before (default: on a GPU, off on the CPU)"),
}
# vLLM's older speculative flags -> speculative_config's keys (--speculative-config is the JSON)
SPECULATIVE_FLAGS = {
    "--speculative-model": ("model", str),
    "--num-speculative-tokens": ("num_speculative_tokens", int),
    "--speculative-draft-tensor-parallel-size": ("draft_tensor_parallel_size", int),
}


def dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    parser.add_argument("model_name", nargs="?", metavar="MODEL",
                        help="catalog name or HF folder (as --model)")
    for field, (flags, kind, help_text) in FLAGS.items():
        parser.add_argument(*flags, dest=field, type=kind, help=help_text)
    for field, (flag, help_text) in SWITCHES.items():
        parser.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction,
                            default=None, help=help_text)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", default=None,
                        help="the same as --no-enable-prefix-caching")
    parser.add_argument("--speculative-config", help="speculative decoding as JSON, vLLM's "
                        "keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    for flag, (key, kind) in SPECULATIVE_FLAGS.items():
        parser.add_argument(flag, dest=dest(flag), type=kind,
                            help=f"vLLM's older flag: speculative_config's {key!r}")
    parser.add_argument("--throughput-optimized", action=argparse.BooleanOptionalAction,
                        default=None, help="Ray Serve's throughput-optimized mode: HTTP reaches "
                        "the ingress replicas without Serve's proxy actor (default: on, or "
                        f"${environment.SERVE_THROUGHPUT_OPTIMIZED.name})")
    add_autoscaling_flags(parser)
    parser.set_defaults(handler=serve_command)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig the flags ask for; ValueError naming each flag that is wrong."""
    if args.model_name and args.model and args.model_name != args.model:
        raise ValueError(f"two models given: {args.model_name!r} and --model {args.model!r}")
    values = {f: getattr(args, f) for f in [*FLAGS, *SWITCHES] if getattr(args, f) is not None}
    if args.model_name:
        values["model"] = args.model_name
    values["speculative_config"] = speculative_config(args)
    values["autoscaling"] = autoscaling_config(args)
    return load_config(values, names=flag_names())


def speculative_config(args: argparse.Namespace) -> dict | None:
    """--speculative-config's JSON with the older flags' keys in it, checked now (a bad one
    would otherwise fail in every replica at start-up)."""
    config: dict = {}
    if args.speculative_config is not None:
        try:
            config = json.loads(args.speculative_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config: not JSON ({error.msg})") from None
        if not isinstance(config, dict):
            raise ValueError("--speculative-config: give a JSON object")
    for flag, (key, _) in SPECULATIVE_FLAGS.items():
        value = getattr(args, dest(flag))
        if value is None:
            continue
        if key in config and config[key] != value:
            raise ValueError(f"{flag} {value!r} contradicts --speculative-config's {key!r}")
        config[key] = value
    if config.get("model") == "[ngram]":  # vLLM's older way to ask for prompt lookup
        config.pop("model")
        config["method"] = "ngram"
    if not config:
        return None
    try:
        SpeculativeConfig.from_dict(config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--speculative-config: {error}") from None
    return config


def flag_names() -> dict[str, str]:
    """ServeConfig field -> the flag that sets it, as error messages name it."""
    names = {field: flags[0] for field, (flags, _, _) in FLAGS.items()}
    return names | {field: flag for field, (flag, _) in SWITCHES.items()}


def serve_command(args: argparse.Namespace) -> int:
    config = serve_config(args)
    # before Ray starts: the Serve processes it launches inherit the environment (a Ray
    # cluster that is already running keeps the value its own processes started with)
    throughput = environment.set_serve_throughput_optimized(args.throughput_optimized) == "1"
    ports = serve_ports(config.port, config.num_ingress_replicas, throughput)
    check_ports_free(config.host, ports)
    if keeps_ray_on_loopback(config.host):
        environment.keep_ray_on_loopback()  # before Ray is imported: it reads it then
    if throughput:
        environment.set_serve_ports(config.port, config.num_ingress_replicas)
    environment.set_serve_quick_stop()
    run_server(config, ports)
    return 0


def keeps_ray_on_loopback(host: str) -> bool:
    """Whether the Ray instance `tandem serve` starts keeps every listener on 127.0.0.1: when
    it serves on a loopback address. Not on a Ray cluster it joins (RAY_ADDRESS, `ray start`),
    whose nodes must reach each other, nor for another --host (0.0.0.0, a real address)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return loopback and not environment.joins_running_ray()


def check_ports_free(host: str, ports: ServePorts) -> None:
    if ports.all[-1] > 65535:
        raise ValueError(f"--port {ports.all[0]} leaves no room for ports up to "
                         f"{ports.all[-1]} (docs/serving.md: Ports): choose a lower --port")
    for port in ports.all:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError as error:
                raise ValueError(f"cannot listen on {host}:{port} ({error.strerror}); tandem "
                                 f"uses ports {ports.all[0]}-{ports.all[-1]} (docs/serving.md: "
                                 "Ports): choose another --port") from None


def run_server(config: ServeConfig, ports: ServePorts) -> None:
    """Serves until SIGTERM or Ctrl-C, then drains (drain.py) and shuts Serve and Ray down."""
    import ray
    from ray import serve

    from cluster.serve.app import APP_NAME, server_app

    init_ray(include_dashboard=False, log_to_driver=True)
    raise_on_signals()
    stopped_by_signal = False
    try:
        # root_url: the URL Serve names when the app is ready, the one clients use (with
        # direct ingress, not its proxy's port)
        serve.start(http_options={"host": config.host, "port": ports.proxy,
                                  "root_url": config.url})
        print(f"tandem: loading {config.model} ...", flush=True)
        # tandem drains the app itself first; Serve then only waits for the last bytes
        serve.run(server_app(config, graceful_shutdown_s=STOP_AFTER_DRAIN_S), name=APP_NAME,
                  route_prefix="/")
        print(serving_message(config, ports), flush=True)
        while True:
            time.sleep(3600)
    except ShutdownRequested:
        stopped_by_signal = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shutdown itself is not interrupted
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if stopped_by_signal:  # also while serve.run still waits: the app may take requests
            drain_and_stop(config.drain_timeout, APP_NAME)
        else:
            print("tandem: shutting down", flush=True)
            stop_serve()
        ray.shutdown()


# after the drain: Serve's own wait for each ingress replica's open responses (their last
# bytes, or those the drain timeout cut off)
STOP_AFTER_DRAIN_S = 2.0


def serving_message(config: ServeConfig, ports: ServePorts) -> str:
    url = config.url
    lines = [f"\ntandem is serving {config.model_name} at {url}/v1",
             f"  metrics: {url}/metrics   health: {url}/health"]
    if len(ports.http) > 1:
        lines.append(f"  ingress replicas at ports {ports.http[0]}-{ports.http[-1]} (spread "
                     f"clients over them); Serve's proxy balances them at port {ports.proxy}, "
                     "at the cost of a hop")
    return "\n".join([*lines, f"try:\n  {config.curl_example()}\n"])
