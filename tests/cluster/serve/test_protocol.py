"""The HTTP layer without Ray: the FastAPI app over a scripted fake cluster, in-process."""

import asyncio
import json

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli.serve import flag_names
from cluster.engine.metrics import EngineMetrics, Histogram, MetricsSnapshot
from cluster.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.serve.app import build_app
from cluster.serve.config import ServeConfig, load_config
from cluster.serve.openai_service import OpenAIService
from cluster.serve.prometheus import METRIC_NAMES, histogram_buckets
from router.placement import ReplicaLoad
from router.replica_router import ClusterHealth, RouterStats

TEXTS = ["He", "Hell", "Hello", "Hello w", "Hello world"]  # what the engine has released


class FakeCluster:
    """Each request yields one snapshot per entry of TEXTS, then finishes by length."""

    max_model_len = 64

    def __init__(self, fail_after: int | None = None,
                 health: ClusterHealth | None = None) -> None:
        self.fail_after, self.state = fail_after, health or ClusterHealth([True, True])
        self.started: list[str] = []
        self.closed: list[str] = []

    async def generate(self, prompt_ids, params, request_id):
        self.started.append(request_id)
        try:
            for step, text in enumerate(TEXTS):
                if self.fail_after is not None and step == self.fail_after:
                    raise RuntimeError("replica 0 lost a shard")
                await asyncio.sleep(0)
                done = step == len(TEXTS) - 1
                outputs = [CompletionOutput(i, list(range(step + 1)), text,
                                            "length" if done else None) for i in range(params.n)]
                yield RequestOutput(request_id, None, prompt_ids, outputs, RequestMetrics(0.0),
                                    finished=done)
        finally:
            self.closed.append(request_id)

    async def health(self) -> ClusterHealth:
        return self.state

    async def metrics(self):
        engine = EngineMetrics()
        engine.on_first_token(5, 0.03, 0.01)
        engine.on_finish("stop", 0.4)
        snapshot = {"time_to_first_token": engine.time_to_first_token,
                    "inter_token_latency": engine.inter_token_latency,
                    "e2e_latency": engine.e2e_latency, "queue_time": engine.queue_time}
        return [MetricsSnapshot(**snapshot, prompt_tokens=5, generation_tokens=7 + r,
                                finished_requests={"stop": 1}, preemptions=0,
                                prefix_cache_queries=5, prefix_cache_hits=0, num_running=r,
                                num_waiting=0, batch_size=r, kv_blocks_used=r, kv_blocks_total=8,
                                spec_decode_accepted_per_position=(3 + r, 1))
                for r in range(2)]

    async def router_stats(self):
        return RouterStats({"affinity": 3, "no_match": 1}, directory_blocks=12, event_lag_s=0.002,
                           loads=[ReplicaLoad(num_requests=2), ReplicaLoad()], resyncs=1,
                           blocks_held=[12, 4], failovers=2, rejected={"overloaded": 5})


def make_client(cluster: FakeCluster, **config) -> httpx.AsyncClient:
    settings = ServeConfig(model="fake", api_key=None, max_body_bytes=2048, **config)
    app = build_app(OpenAIService(cluster, None, "fake"), settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")


def events(text: str) -> list:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def run(coroutine):
    return asyncio.run(coroutine)


def test_stream_sends_each_new_piece_once_and_usage_last():
    async def go():
        async with make_client(FakeCluster()) as client:
            r = await client.post("/v1/completions", json={
                "prompt": [1, 2, 3], "n": 2, "stream": True,
                "stream_options": {"include_usage": True}})
            return events(r.text)

    chunks = run(go())
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 10,
                                   "total_tokens": 13}
    for index in (0, 1):
        pieces = [c["text"] for chunk in chunks[:-2] for c in chunk["choices"]
                  if c["index"] == index]
        assert "".join(pieces) == "Hello world" and len(pieces) == 5


def test_error_mid_stream_is_an_event_and_closes_the_request():
    cluster = FakeCluster(fail_after=2)

    async def go():
        async with make_client(cluster) as client:
            r = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
            return r.status_code, events(r.text)

    status, chunks = run(go())
    assert status == 200 and chunks[-1] == "[DONE]"
    error = chunks[-2]["error"]
    # the replica's own words ("lost a shard") go to the log, not to the client
    assert error["type"] == "server_error" and "lost a shard" not in error["message"]
    assert error["message"].startswith("The server failed while running this request")
    assert cluster.closed == cluster.started


def test_several_prompts_run_as_several_requests():
    cluster = FakeCluster()

    async def go():
        async with make_client(cluster) as client:
            r = await client.post("/v1/completions", json={"prompt": [[1], [2, 3]], "n": 2})
            return r.json()

    body = run(go())
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 3 and len(cluster.started) == 2


@pytest.mark.parametrize(("health", "body"), [
    (ClusterHealth([True, True]), {"status": "ok", "replicas": 2, "replicas_up": 2}),
    # one replica rebuilding: the other serves, so the server is up, and says it is degraded
    (ClusterHealth([True, False]), {"status": "degraded", "replicas": 2, "replicas_up": 1}),
])
def test_health_is_200_while_a_replica_serves(health, body):
    async def go():
        async with make_client(FakeCluster(health=health)) as client:
            return await client.get("/health")

    response = run(go())
    assert (response.status_code, response.json()) == (200, body)


@pytest.mark.parametrize(("health", "message"), [
    (ClusterHealth([False, False]), "No engine replica is serving now: they are down or "
                                    "restarting."),
    (ClusterHealth([True, True], draining=True), "The server is shutting down and takes no "
                                                 "new requests."),
])
def test_health_is_503_with_retry_after_when_none_serves_or_it_drains(health, message):
    async def go():
        async with make_client(FakeCluster(health=health), retry_after=7) as client:
            return await client.get("/health")

    response = run(go())
    assert (response.status_code, response.headers["retry-after"]) == (503, "7")
    assert response.json()["error"] == {"message": message, "type": "service_unavailable",
                                        "param": None, "code": health.status}


def test_chunked_body_over_the_limit_is_413():
    async def chunks():
        for _ in range(10):
            yield b" " * 1024

    async def go():
        async with make_client(FakeCluster()) as client:
            return await client.post("/v1/completions", content=chunks(),
                                     headers={"Content-Type": "application/json"})

    response = run(go())
    assert response.status_code == 413 and "2048 bytes" in response.json()["error"]["message"]


def test_text_prompt_without_tokenizer_is_400():
    async def go():
        async with make_client(FakeCluster()) as client:
            return await client.post("/v1/completions", json={"prompt": "hi"})

    response = run(go())
    assert response.status_code == 400 and "token ids" in response.json()["error"]["message"]


def test_metrics_label_every_replica():
    async def go():
        async with make_client(FakeCluster()) as client:
            return (await client.get("/metrics")).text

    families = {f.name: f for f in text_string_to_metric_families(run(go()))}
    samples = {s.name for f in families.values() for s in f.samples}
    assert all(name in families or name in samples for name in METRIC_NAMES)
    running = families["tandem:num_requests_running"].samples
    assert {s.labels["replica"]: s.value for s in running} == {"0": 0.0, "1": 1.0}
    usage = [s.value for s in families["tandem:kv_cache_usage_perc"].samples]
    assert usage == [0.0, 0.125]
    decisions = {s.labels["reason"]: s.value for s in families["tandem:router_decisions"].samples
                 if s.name.endswith("_total")}
    assert decisions == {"affinity": 3.0, "no_match": 1.0, "load_guard": 0.0,
                         "least_loaded": 0.0, "round_robin": 0.0, "pull": 0.0}
    in_flight = families["tandem:router_requests_in_flight"].samples
    assert {s.labels["replica"]: s.value for s in in_flight} == {"0": 2.0, "1": 0.0}
    assert [s.value for s in families["tandem:kv_directory_blocks"].samples] == [12.0]
    assert [s.value for s in families["tandem:request_failovers"].samples
            if s.name.endswith("_total")] == [2.0]
    rejected = {s.labels["reason"]: s.value for s in families["tandem:requests_rejected"].samples
                if s.name.endswith("_total")}
    assert rejected == {"overloaded": 5.0, "draining": 0.0}
    per_position = families["tandem:spec_decode_num_accepted_tokens_per_pos"].samples
    assert {(s.labels["replica"], s.labels["position"]): s.value for s in per_position} == {
        ("0", "0"): 3.0, ("0", "1"): 1.0, ("1", "0"): 4.0, ("1", "1"): 1.0}


def test_histogram_buckets_are_cumulative():
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 5.0):
        histogram.observe(value)
    assert histogram_buckets(histogram) == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]


def test_config_errors_name_the_flags():
    with pytest.raises(ValueError) as error:
        load_config({"tensor_parallel_size": 0, "port": 70000, "dtype": "fp8"}, flag_names())
    message = str(error.value)  # vLLM's flag names (--tp stays an alias)
    assert "--tensor-parallel-size:" in message and "--port:" in message and "--dtype:" in message


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")
    assert ServeConfig().api_key == "sk-env"
    assert ServeConfig(api_key="sk-flag").api_key == "sk-flag"
    assert "Bearer sk-env" in ServeConfig().curl_example()


def test_ingress_replicas_auto_is_four_on_a_gpu_one_on_the_cpu():
    assert ServeConfig(device="cpu").num_ingress_replicas == 1
    assert ServeConfig(device="cuda").num_ingress_replicas == 4
    assert ServeConfig(device="cuda", ingress_replicas=2).num_ingress_replicas == 2
    with pytest.raises(ValueError, match="ingress_replicas"):
        load_config({"ingress_replicas": -1})
