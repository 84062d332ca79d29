"""`tandem serve`: start a local Ray cluster and serve the OpenAI-compatible API on it.

Flags left out take ``ServeConfig``'s defaults; pydantic checks the rest and every problem
is reported at once, one line per flag.
"""

import argparse
import json
import signal
import socket
import sys
import time

from cluster import environment
from cluster.cli.autoscaling_flags import add_autoscaling_flags, autoscaling_config
from cluster.engine.config import DEFAULT_MODEL
from cluster.serve.config import ServeConfig, load_config
from workers.spec.config import SpeculativeConfig

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
    "port": (("--port",), int, "HTTP port (default: 8000)"),
    "api_key": (("--api-key",), str, "require this bearer key on /v1 (default: "
                f"${environment.API_KEY.name})"),
    "max_body_bytes": (("--max-body-bytes",), int, "larger request bodies get 413 (4 MiB)"),
    "dtype": (("--dtype",), str, "auto | float32 | bfloat16 | float16"),
    "kv_cache_dtype": (("--kv-cache-dtype",), str, "auto (as --dtype) | int8 | fp8 (e4m3, "
                       "GPUs of compute capability 8.9+): about twice the KV blocks"),
    "device": (("--device",), str, "auto | cpu | cuda"),
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
    "decode_steps": (("--decode-steps",), int, "decode steps per worker call (default: 0, auto)"),
    "seed": (("--seed",), int, "engine seed (default: 0)"),
    "host_kv_cache_gb": (("--host-kv-cache-gb",), float, "host memory per replica for "
                         "offloaded KV blocks, in GiB (default: 0, off)"),
    "disk_kv_cache_dir": (("--disk-kv-cache-dir",), str, "a directory for KV blocks leaving "
                          "the host tier, shareable by replicas (default: none)"),
    "disk_kv_cache_gb": (("--disk-kv-cache-gb",), float, "size bound of the disk tier, in GiB "
                         "(default: 10)"),
    "routing": (("--routing",), str, "prefix-affinity (default) | least-loaded | round-robin"),
}
SWITCHES = {  # ServeConfig field -> (flag, help): --flag / --no-flag
    "enable_chunked_prefill": ("--enable-chunked-prefill", "prefill prompts in chunks mixed "
                               "with decodes (default: on)"),
    "enable_prefix_caching": ("--enable-prefix-caching", "share the KV blocks of common "
                              "prefixes (default: on)"),
    "decode_lookahead": ("--decode-lookahead", "multi-step calls also run the next call's first "
                         "step (default: off for serving)"),
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
    check_port_free(config)
    # before Ray starts: the Serve processes it launches inherit the environment (a Ray
    # cluster that is already running keeps the value its own processes started with)
    environment.set_serve_throughput_optimized(args.throughput_optimized)
    run_server(config)
    return 0


def check_port_free(config: ServeConfig) -> None:
    with socket.socket() as sock:
        try:
            sock.bind((config.host, config.port))
        except OSError as error:
            raise ValueError(f"cannot listen on {config.host}:{config.port} ({error.strerror}):"
                             " choose another --port") from None


def run_server(config: ServeConfig) -> None:
    """Blocks until Ctrl-C, then shuts Serve and Ray down."""
    import ray
    from ray import serve

    from cluster.serve.app import server_app

    ray.init(include_dashboard=False, log_to_driver=True)
    # `kill` and container stops send SIGTERM: shut down as cleanly as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        print(f"tandem: loading {config.model} ...", flush=True)
        serve.run(server_app(config), name="tandem", route_prefix="/")
        print(f"\ntandem is serving {config.model_name} at {config.url}/v1\n"
              f"  metrics: {config.url}/metrics   health: {config.url}/health\n"
              f"try:\n  {config.curl_example()}\n", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        print("tandem: shutting down", flush=True)
        serve.shutdown()
        ray.shutdown()
