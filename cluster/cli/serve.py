"""`tandem serve`: start a local Ray cluster and serve the OpenAI-compatible API on it.

Flags left out take ``ServeConfig``'s defaults; pydantic checks the rest and every problem
is reported at once, one line per flag.
"""

import argparse
import signal
import socket
import sys
import time

from cluster import environment
from cluster.engine.config import DEFAULT_MODEL
from cluster.serve.config import ServeConfig, load_config

FLAGS = {  # flag -> (ServeConfig field, type, help)
    "--model": ("model", str, f"catalog name or HF folder (default: {DEFAULT_MODEL})"),
    "--served-model-name": ("served_model_name", str, "the name clients send as `model`"),
    "--tp": ("tensor_parallel_size", int, "tensor-parallel GPUs per replica (default: 1)"),
    "--replicas": ("num_replicas", int, "engine replicas (default: 1)"),
    "--ingress-replicas": ("ingress_replicas", int,
                           "HTTP ingress replicas (default: 0, auto: 4 on a GPU, 1 on the CPU)"),
    "--host": ("host", str, "bind address (default: 127.0.0.1)"),
    "--port": ("port", int, "HTTP port (default: 8000)"),
    "--api-key": ("api_key", str, "require this bearer key on /v1 (default: "
                f"${environment.API_KEY.name})"),
    "--max-body-bytes": ("max_body_bytes", int, "larger request bodies get 413 (default 4 MiB)"),
    "--dtype": ("dtype", str, "auto | float32 | bfloat16 | float16"),
    "--device": ("device", str, "auto | cpu | cuda"),
    "--max-model-len": ("max_model_len", int, "context length (default: the model's)"),
    "--num-kv-blocks": ("num_kv_blocks", int, "KV blocks per replica (default: from memory)"),
    "--block-size": ("block_size", int, "tokens per KV block (default: 16)"),
    "--max-num-seqs": ("max_num_seqs", int, "sequences per batch at most (default: 64)"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "tokens per step at most"),
    "--decode-steps": ("decode_steps", int, "decode steps per worker call (default: 0, auto)"),
    "--seed": ("seed", int, "engine seed (default: 0)"),
    "--routing": ("routing", str, "prefix-affinity (default) | least-loaded | round-robin"),
}


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    for flag, (field, kind, help_text) in FLAGS.items():
        parser.add_argument(flag, dest=field, type=kind, help=help_text)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", default=None, help="turn the prefix cache off")
    parser.add_argument("--decode-lookahead", dest="decode_lookahead",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="multi-step calls also run the next call's first step "
                        "(default: off for serving)")
    parser.add_argument("--throughput-optimized", action=argparse.BooleanOptionalAction,
                        default=None, help="Ray Serve's throughput-optimized mode: HTTP reaches "
                        "the ingress replicas without Serve's proxy actor (default: on, or "
                        f"${environment.SERVE_THROUGHPUT_OPTIMIZED.name})")
    parser.set_defaults(handler=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    fields = [field for field, _, _ in FLAGS.values()] + ["enable_prefix_caching",
                                                          "decode_lookahead"]
    values = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    config = load_config(values, names={field: flag for flag, (field, _, _) in FLAGS.items()})
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
