"""Every environment variable tandem reads or sets, in one place.

Only the edges call this module: the CLI, the Serve app builder, the config objects' defaults
(made where a user or an entry point makes them) and a shard actor's start-up, which must set
CUDA and NCCL variables in its own process before they are read. Everything below gets plain
config objects. ``VARIABLES`` is what a user may set; docs/configuration.md's table lists the
same names.
"""

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str


CACHE_DIR = Variable("TANDEM_CACHE_DIR", "~/.cache/tandem",
                     "where catalog models are pulled and converted, and bench shapes built")
API_KEY = Variable("TANDEM_API_KEY", "none",
                   "the bearer key the server requires on /v1 (`--api-key` wins)")
PEER_SUM = Variable("TANDEM_PEER_SUM", "push", "the default of `peer_sum_kernel`: "
                    "`push` or `one_shot` (PyTorch's kernel)")
# read by Ray Serve itself, in every Serve process as it starts: HTTP goes straight to the
# ingress replicas (direct ingress) instead of through the proxy actor
SERVE_THROUGHPUT_OPTIMIZED = Variable(
    "RAY_SERVE_THROUGHPUT_OPTIMIZED", "1", "Ray Serve's throughput-optimized mode for the Ray "
    "instance `tandem serve` starts (`--[no-]throughput-optimized` wins); on a running Ray "
    "cluster, set it in the nodes' environment")
VARIABLES = (CACHE_DIR, API_KEY, PEER_SUM, SERVE_THROUGHPUT_OPTIMIZED)


def cache_dir() -> Path:
    value = os.environ.get(CACHE_DIR.name)
    return Path(value) if value else Path.home() / ".cache" / "tandem"


def api_key() -> str | None:
    return os.environ.get(API_KEY.name) or None


def peer_sum_kernel() -> str:
    return os.environ.get(PEER_SUM.name) or PEER_SUM.default


def set_serve_throughput_optimized(flag: bool | None) -> str:
    """Sets RAY_SERVE_THROUGHPUT_OPTIMIZED for the Ray instance about to start (its processes
    inherit it): the flag when given, else the environment's value, else on. Returns it."""
    name = SERVE_THROUGHPUT_OPTIMIZED.name
    if flag is not None:
        value = "1" if flag else "0"
    else:
        value = os.environ.get(name) or SERVE_THROUGHPUT_OPTIMIZED.default
    os.environ[name] = value
    return value


def set_serve_ports(first_port: int, num_ingress_replicas: int) -> None:
    """Pins where Ray Serve's direct ingress listens, for the Ray instance about to start (its
    processes read these as they start): ingress replica i takes HTTP port ``first_port + i``,
    and any gRPC listener one opens comes from the n ports after the proxy's (``first_port +
    n``), instead of Serve's 30000-31000 and 40000-41000. A released port is reusable at once
    (Serve holds it back for HAProxy, which tandem does not run), so a replaced replica finds
    its port. Set only by `tandem serve`, which chooses the ports; docs/serving.md lists them."""
    n = num_ingress_replicas
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(first_port)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(first_port + n)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"] = str(first_port + n + 1)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"] = str(first_port + 2 * n + 1)
    os.environ["RAY_SERVE_PORT_QUARANTINE_S"] = "0"


def joins_running_ray() -> bool:
    """Whether ``ray.init()`` here joins a Ray cluster that is already running rather than
    start one, as Ray decides it: RAY_ADDRESS names one (anything but ``local``), or, without
    RAY_ADDRESS, a `ray start` on this machine left its address where Ray looks for it
    ($RAY_TMPDIR, else $TMPDIR, else /tmp; then ray/ray_current_cluster)."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address:
        return address != "local"
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return (Path(temp) / "ray" / "ray_current_cluster").exists()


def keep_ray_on_loopback() -> None:
    """The Ray instance about to start takes 127.0.0.1 as this node's address, as it does on
    macOS and Windows, so that everything it starts (GCS, raylet, workers, its agents' and
    metrics' ports) listens on the loopback address only. Ray reads this when it is imported,
    so it must be set before; ``ray.init(_node_ip_address="127.0.0.1")`` cannot do it (Ray
    2.60 turns a loopback address given there into the node's outward one). Only for a Ray
    instance of `tandem serve`'s own that serves on a loopback --host: a node of a cluster
    needs an address the others reach."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def set_serve_quick_stop() -> None:
    """A stopping ingress replica goes at once: Serve would keep it taking requests for 30 s
    (its direct-ingress draining period) so load balancers notice; `tandem serve` has drained
    it already, with 503s and /health saying so (cluster/cli/drain.py)."""
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"


def set_one_torch_thread() -> None:
    """One OpenMP thread in this process and every process it starts, unless the caller set
    a count (the test suite, before torch loads: on 2 cores shared with Ray's processes a
    second thread made small ops wait at OpenMP's barrier for a core)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def prepare_shard_process(on_gpu: bool, tensor_parallel: bool,
                          replica_gpus: list[str] | None) -> None:
    """What a shard's own process must set before CUDA, NCCL and symmetric memory start."""
    if not on_gpu:
        return
    if replica_gpus:
        # Ray shows an actor only its own GPU; PyTorch's peer-memory rendezvous refuses ranks on
        # the same device index, so each shard sees all of its replica's GPUs and picks its own
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(replica_gpus)
    if tensor_parallel:
        # decode CUDA graphs capture NCCL collectives: no recordStream on their buffers (read
        # when the process group is made)
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
        disable_symmetric_memory_multicast()


def disable_symmetric_memory_multicast() -> None:
    """No NVLink multicast object at a symmetric-memory rendezvous: nothing of ours uses it, and
    on some hosts creating one is unsafe (PyTorch reads this when the first buffer is mapped)."""
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def quiet_blocking_get_warning() -> None:
    """Ray warns at any ``ray.get`` in an async actor's process; a replica actor calls it only
    in its constructor or on worker threads, never on its event loop, so the warning is noise."""
    os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
