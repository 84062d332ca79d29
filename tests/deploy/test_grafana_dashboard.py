"""deploy/grafana/tandem.json reads only what /metrics exports, and has a panel for each item of
the brief's monitoring list.

The exported names are not listed here: they come from the registry /metrics renders
(cluster/serve/prometheus.py), fed a replica snapshot in which every family has samples (a
GPU, drafts accepted), and read back from its text as Prometheus would scrape it, so
histograms' _bucket/_sum/_count and counters' _total are the names PromQL sees.
"""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.metrics import empty_snapshot
from cluster.serve.prometheus import make_registry, render
from router.replica_router import ReplicaLoad, RouterStats
from workers.device_stats import DeviceStats

DASHBOARD = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana"
                        / "tandem.json").read_text())
METRIC = re.compile(r"tandem:[A-Za-z0-9_:]+")
SELECTOR = re.compile(r"(tandem:[A-Za-z0-9_:]+)\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)")

# the brief's monitoring list: panel title -> sample names its expressions must read
MONITORING = {
    "Time to first token": {"tandem:time_to_first_token_seconds_bucket"},
    "Inter-token latency": {"tandem:inter_token_latency_seconds_bucket"},
    "Tokens/s per request": {"tandem:request_generation_tokens_per_second_bucket"},
    "Tokens/s in total": {"tandem:generation_tokens_total"},
    "GPU utilization": {"tandem:gpu_utilization"},
    "GPU memory used": {"tandem:gpu_memory_used_bytes"},
    "KV blocks used": {"tandem:kv_cache_blocks_used"},
    "Prefix cache hit rate by tier": {"tandem:prefix_cache_hits_total",
                                      "tandem:prefix_cache_queries_total"},
    "Draft acceptance": {"tandem:spec_decode_num_accepted_tokens_total",
                         "tandem:spec_decode_num_draft_tokens_total"},
    "Speculative speedup": {"tandem:spec_decode_speedup"},
    "Batch size": {"tandem:step_batch_size_sum", "tandem:step_batch_size_count",
                   "tandem:step_batch_size_bucket"},
    "Queue length": {"tandem:num_requests_waiting"},
    "Queue wait p99": {"tandem:request_queue_time_seconds_bucket"},
    "Replicas": {"tandem:num_requests_running"},
    "Failovers and refusals": {"tandem:request_failovers_total"},
}
QUANTILES = {"Time to first token": ["0.5", "0.99"], "Inter-token latency": ["0.5", "0.99"],
             "Tokens/s per request": ["0.5", "0.99"], "Batch size": ["0.99"],
             "Queue wait p99": ["0.99"]}


def exported() -> dict[str, set[str]]:
    """Every sample name /metrics shows -> the labels its samples carry."""
    snapshot = replace(empty_snapshot(), replica=0, spec_decode_accepted_per_position=(3, 1),
                       devices=(DeviceStats(0, 0.5, 10 << 30, 80 << 30, 8 << 30),))
    stats = RouterStats({"affinity": 1}, directory_blocks=4, event_lag_s=0.001,
                        loads=[ReplicaLoad(num_requests=1)], resyncs=0, blocks_held=[4])
    text = render(make_registry("m", lambda: [snapshot], lambda: stats)).decode()
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


EXPORTED = exported()


def panels() -> list[dict]:
    return [panel for panel in DASHBOARD["panels"] if panel["type"] != "row"]


def expressions() -> list[str]:
    exprs = [target["expr"] for panel in panels() for target in panel["targets"]]
    return exprs + [v["query"]["query"] for v in DASHBOARD["templating"]["list"]
                    if v["type"] == "query"]


def test_the_registry_exports_every_kind_of_family():
    # the snapshot above gives every family samples: the check below sees them all
    assert {"tandem:gpu_utilization", "tandem:time_to_first_token_seconds_bucket",
            "tandem:time_to_first_token_seconds_sum", "tandem:prompt_tokens_total",
            "tandem:request_failovers_total"} <= EXPORTED.keys()


@pytest.mark.parametrize("expr", expressions())
def test_every_expression_reads_exported_metrics_by_their_labels(expr):
    names = METRIC.findall(expr)
    assert names, f"no tandem metric in {expr!r}"
    assert [name for name in names if name not in EXPORTED] == []
    for name, matchers in SELECTOR.findall(expr):
        assert set(MATCHER.findall(matchers)) <= EXPORTED[name], (name, matchers)
    labels = set().union(*(EXPORTED[name] for name in names))
    for grouping in GROUPING.findall(expr):
        assert {label.strip() for label in grouping.split(",")} <= labels, (expr, grouping)


def test_a_panel_for_each_item_of_the_monitoring_list():
    by_title = {panel["title"]: panel for panel in panels()}
    for title, names in MONITORING.items():
        exprs = [target["expr"] for target in by_title[title]["targets"]]
        assert names <= {name for expr in exprs for name in METRIC.findall(expr)}, title
        quantiles = [q for expr in exprs for q in re.findall(r"histogram_quantile\(([\d.]+)",
                                                             expr)]
        assert quantiles == QUANTILES.get(title, []), title


def test_the_dashboard_imports_into_any_grafana_with_a_prometheus_source():
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in
                                                           range(len(panel["targets"]))]
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # every expression keeps to the chosen models
    assert all('{model_name=~"$model"}' in target["expr"]
               for panel in panels() for target in panel["targets"])
