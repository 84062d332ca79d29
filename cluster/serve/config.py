"""The server's configuration, from `tandem serve` flags or a Serve config file's `args`.

Pydantic checks it once, at the edge, and every problem comes back as one readable line per
field; inside, the engine gets a plain ``EngineConfig``.
"""

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cluster import environment
from cluster.engine.config import DEFAULT_MODEL, EngineConfig
from cluster.ray.serving_policy import ServingPolicy
from router.autoscale import AutoscalingPolicy

AUTO_GPU_INGRESS_REPLICAS = 4


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL, min_length=1,
                       description="A catalog name or a HuggingFace model folder.")
    served_model_name: str | None = Field(None, description="The name clients use; default: "
                                          "the catalog name or the folder's name.")
    tensor_parallel_size: int = Field(1, ge=1, le=8, description="GPUs per replica.")
    num_replicas: int = Field(1, ge=1, le=64, description="Engine replicas behind the router.")
    ingress_replicas: int = Field(0, ge=0, le=64, description="HTTP ingress replicas, all in "
                                  "front of the same engine replicas; 0: auto (4 on a GPU, 1 on "
                                  "the CPU).")
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    api_key: str | None = Field(default_factory=environment.api_key,
                                description="Required as 'Authorization: Bearer <key>' "
                                f"on /v1 routes; default: ${environment.API_KEY.name}.")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="Larger request bodies get 413.")
    max_ongoing_requests: int = Field(1024, ge=1, description="Requests the ingress accepts "
                                      "at once.")
    max_waiting_requests: int = Field(0, ge=0, description="Per engine replica, requests "
                                      "without a first token yet; past it on every replica a new "
                                      "request gets 503 with Retry-After at once. 0: no limit.")
    max_waiting_tokens: int = Field(0, ge=0, description="Per engine replica, the prompt tokens "
                                    "of those requests; the same 503 past it. 0: no limit.")
    retry_after: int = Field(2, ge=1, description="Seconds a 503 (overloaded, draining, no "
                             "replica) asks the client to wait: its Retry-After header.")
    request_timeout: float = Field(0.0, ge=0, description="Seconds a request may take before "
                                   "it is stopped (504); a client's X-Request-Timeout header "
                                   "may ask for less. 0: no limit.")
    failover_timeout: float = Field(30.0, gt=0, description="Seconds a request whose replica "
                                    "was lost keeps looking for one to continue on (then 503).")
    health_check_period: float = Field(1.0, gt=0, description="Seconds between pings of every "
                                       "replica and its shards.")
    replica_start_timeout: float = Field(600.0, gt=0, description="Seconds an engine replica "
                                         "may take to come up (a node for its shards, the "
                                         "weights loaded) before it fails with an error "
                                         "saying so.")
    drain_timeout: float = Field(30.0, ge=0, description="On SIGTERM or Ctrl-C, seconds the "
                                 "requests in flight get to finish (`tandem serve`).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The weights' and activations' dtype.")
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        "auto", description="How the KV cache stores K and V: auto (as dtype), int8 or fp8 "
        "(e4m3, GPUs of compute capability 8.9+), each with a scale per token and head.")
    device: str = Field("auto", description="auto (cuda when present, else cpu) | cpu | "
                        "cuda | cuda:N (served as cuda: Ray gives each shard a GPU of its "
                        "own).")
    max_model_len: int | None = Field(None, ge=2, description="Context length; default: the "
                                      "model's.")
    num_kv_blocks: int | None = Field(None, ge=1, description="Default: sized from memory.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences in a batch at most.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Tokens in a step at most.")
    enable_prefix_caching: bool = Field(True, description="Share KV blocks of equal prefixes.")
    enable_chunked_prefill: bool = Field(True, description="Prefill prompts in chunks mixed "
                                         "with decodes; false: a prompt in one step.")
    scheduler_delay_factor: float = Field(0.0, ge=0, description="While others run, new "
                                          "prompts wait this many times the last step, so "
                                          "more of them prefill together.")
    tpot_target_ms: float = Field(0.0, ge=0, description="A step's token budget from its "
                                  "measured cost: the most tokens (up to "
                                  "max_num_batched_tokens) within this time; 0: fixed.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Share of the GPU's "
                                          "memory each engine takes.")
    decode_steps: int = Field(0, ge=0, le=64, description="Decode steps per call to the workers "
                              "when every request decodes; 0: auto (8 on a GPU, 1 on the CPU).")
    decode_lookahead: bool = Field(False, description="Multi-step calls also run the next "
                                   "call's first step while the host schedules it. Off for "
                                   "serving: arrivals drop most lookaheads, and W3 measured "
                                   "lower HTTP throughput with it.")
    async_scheduling: bool | None = Field(None, description="Schedule each step while the "
                                          "workers run the one before (its tokens come back "
                                          "with the next call); steps with drafts wait for "
                                          "their tokens. None: on a GPU, "
                                          "off on the CPU.")
    seed: int = Field(0, description="Seed of the engines' random state.")
    host_kv_cache_gb: float = Field(0.0, ge=0, description="Host memory per replica for KV "
                                    "blocks offloaded from the device (written through, loaded "
                                    "back on a prefix miss and after a preemption), in GiB; "
                                    "0: off.")
    disk_kv_cache_dir: str | None = Field(None, min_length=1, description="A directory for KV "
                                          "blocks leaving the host tier, which replicas and "
                                          "nodes of the same model may share; needs "
                                          "host_kv_cache_gb.")
    disk_kv_cache_gb: float = Field(10.0, gt=0, description="Size bound of each replica's "
                                    "view of the disk tier, in GiB.")
    speculative_config: dict[str, Any] | None = Field(None, description="Speculative decoding, "
                                                      "in vLLM's keys (EngineConfig's).")
    routing: Literal["prefix-affinity", "least-loaded", "round-robin"] = Field(
        "prefix-affinity", description="How a request finds its replica: where its prefix is "
        "cached (with a load guard), the fewest requests in flight, or in turn.")
    autoscaling: AutoscalingPolicy | None = Field(None, description="Engine replicas added "
                                                  "and removed with the load between "
                                                  "min_replicas and max_replicas (fields: "
                                                  "router/autoscale.py); num_replicas, if "
                                                  "given, is the count to start with.")

    @field_validator("device")
    @classmethod
    def _a_device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
            raise PydanticCustomError("device", "Input should be 'auto', 'cpu', 'cuda' or "
                                      "'cuda:N'")
        return device

    @model_validator(mode="after")
    def _start_within_the_bounds(self) -> "ServeConfig":
        bounds = self.autoscaling
        if bounds is not None and "num_replicas" in self.model_fields_set and not (
                bounds.min_replicas <= self.num_replicas <= bounds.max_replicas):
            raise ValueError(f"num_replicas ({self.num_replicas}) is the count autoscaling "
                             f"starts with: give one in min_replicas..max_replicas "
                             f"({bounds.min_replicas}..{bounds.max_replicas}), or leave it out "
                             "to start at min_replicas")
        return self

    @property
    def initial_replicas(self) -> int:
        """The engine replicas to start: num_replicas, or autoscaling's min_replicas when only
        that was given."""
        if self.autoscaling is not None and "num_replicas" not in self.model_fields_set:
            return self.autoscaling.min_replicas
        return self.num_replicas

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.name if path.is_dir() else self.model

    @property
    def num_ingress_replicas(self) -> int:
        """ingress_replicas, with auto resolved. On a GPU one ingress replica's event loop
        limits streaming at a few dozen concurrent streams (W3: HTTP kept 75-79% of in-process
        tokens/s at concurrency 32 with one, 87% with four); on the CPU every replica competes
        with the engine for the same cores. Decided where the app is built: a head node without
        a GPU gets 1."""
        if self.ingress_replicas:
            return self.ingress_replicas
        return AUTO_GPU_INGRESS_REPLICAS if self.engine_config().resolved_device != "cpu" else 1

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device,
            kv_cache_dtype=self.kv_cache_dtype, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend="ray" if self.tensor_parallel_size > 1 else "uni",
            decode_steps=self.decode_steps, decode_lookahead=self.decode_lookahead,
            async_scheduling=self.async_scheduling,
            seed=self.seed, enable_chunked_prefill=self.enable_chunked_prefill,
            scheduler_delay_factor=self.scheduler_delay_factor,
            tpot_target_ms=self.tpot_target_ms,
            gpu_memory_utilization=self.gpu_memory_utilization,
            speculative_config=self.speculative_config,
            host_kv_cache_gb=self.host_kv_cache_gb, disk_kv_cache_dir=self.disk_kv_cache_dir,
            disk_kv_cache_gb=self.disk_kv_cache_gb,
        )

    def serving_policy(self) -> ServingPolicy:
        return ServingPolicy(
            max_waiting_requests=self.max_waiting_requests,
            max_waiting_tokens=self.max_waiting_tokens, retry_after_s=self.retry_after,
            failover_timeout_s=self.failover_timeout,
            health_check_period_s=self.health_check_period,
            replica_start_timeout_s=self.replica_start_timeout)

    def curl_example(self) -> str:
        auth = f" -H 'Authorization: Bearer {self.api_key}'" if self.api_key else ""
        body = json.dumps({"model": self.model_name, "max_tokens": 32, "messages": [
            {"role": "user", "content": "What is the capital of France?"}]})
        return (f"curl {self.url}/v1/chat/completions -H 'Content-Type: application/json'"
                f"{auth} -d '{body}'")


def load_config(values: dict[str, object], names: dict[str, str] | None = None) -> ServeConfig:
    """A ServeConfig, or ValueError with one line per problem; ``names`` renames fields in the
    messages (to the command line's flags)."""
    try:
        return ServeConfig.model_validate(values)
    except ValidationError as error:
        names = names or {}
        lines = [f"  {field_path(e['loc'], names)}: {e['msg']}" for e in error.errors()]
        raise ValueError("invalid server configuration:\n" + "\n".join(lines)) from None


def field_path(loc: tuple[int | str, ...], names: dict[str, str]) -> str:
    """Where a problem is: the field (renamed to its flag) and any key inside it, as
    ``autoscaling.max_replicas``; 'config' for the whole."""
    if not loc:
        return "config"
    return ".".join([names.get(str(loc[0]), str(loc[0])), *map(str, loc[1:])])
