"""`tandem bench serve` — W3, online serving: the same load through the HTTP API and in-process.

A load is fixed concurrency (C requests always in flight), Poisson arrivals (rate r/s), or both
(arrivals at r/s, at most C in flight: vLLM's --request-rate with --max-concurrency). Each
request streams; we time the first token (TTFT), every later chunk (ITL), the end (e2e), and
TPOT = (e2e - TTFT) / (output tokens - 1). Goodput counts requests per second that meet
``--goodput`` (vLLM's flag; TTFT < 200 ms and TPOT < 20 ms by default). Beside the loads, the
load's capacity bound on this machine, and with ``--find-slo-rate`` the highest Poisson rate
each path serves within ``--slo`` (cluster/bench/serve_slo.py). The in-process run drives
``TandemCluster`` directly, the HTTP run goes through Ray Serve and the OpenAI API: their
ratio is the cost of serving.

With ``--base-url`` nothing starts here: the HTTP run alone goes to that OpenAI-compatible
server (tandem, vLLM, SGLang). The flags and the result keys are vLLM's `vllm bench serve`'s
(cluster/bench/vllm_results.py), so one command line measures each server the same way.
"""

import argparse
import asyncio
import random
import time
from pathlib import Path

from cluster import environment
from cluster.bench.http_clients import ClientError, HttpClients, httpx_module
from cluster.bench.serve_load import (
    SAFE_VOCAB,
    Load,
    goodput_slo,
    in_process_sender,
    run_loads,
    runner_of,
)
from cluster.bench.serve_slo import (
    add_slo_arguments,
    check_slo_arguments,
    measure_bound,
    plot_sweeps,
    slo_table,
    sweep,
)
from cluster.bench.vllm_results import result_file_name
from cluster.cli.serve_ports import ServePorts, serve_ports
from cluster.ray.start import init_ray

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_CONCURRENCIES = "1,8,32,128"


# -- the command --------------------------------------------------------------------------------


def add_serve_bench_parser(workloads: argparse._SubParsersAction) -> None:
    parser = workloads.add_parser(
        "serve", help="W3: online serving, HTTP vs in-process, or any server with --base-url",
        description="vLLM's `vllm bench serve` flags: --dataset-name random, "
        "--random-input-len, --random-output-len, --num-prompts, --request-rate, "
        "--max-concurrency, --save-result, --result-dir, --base-url.")
    add_load_arguments(parser)
    add_target_arguments(parser)
    add_result_arguments(parser)
    add_slo_arguments(parser.add_argument_group("goodput, the SLO and the sweep"))
    add_local_arguments(parser.add_argument_group("the local cluster (without --base-url)"))
    parser.set_defaults(handler=serve_bench)


def random_dataset_only(name: str) -> str:
    if name != "random":
        raise argparse.ArgumentTypeError(
            f"only 'random' is supported (random token ids), not {name!r}")
    return name


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", type=random_dataset_only, default="random",
                        help="prompts: 'random' (random token ids; the only one supported)")
    parser.add_argument("--random-input-len", "--input-len", dest="input_len", type=int,
                        metavar="N", default=1024,
                        help="prompt tokens a request (default: %(default)s)")
    parser.add_argument("--random-output-len", "--output-len", dest="output_len", type=int,
                        metavar="N", default=128,
                        help="output tokens a request, EOS ignored (default: %(default)s)")
    parser.add_argument("--num-prompts", "--num-requests", dest="num_requests", type=int,
                        metavar="N", default=0,
                        help="requests a load (default: 8 x concurrency, at least 32)")
    parser.add_argument("--max-concurrency", "--concurrency", dest="concurrency", metavar="C,..",
                        help="comma-separated caps on requests in flight ('' for none); "
                        f"with neither this nor --request-rate: {DEFAULT_CONCURRENCIES}")
    parser.add_argument("--request-rate", default="", metavar="R,..",
                        help="comma-separated Poisson arrival rates in requests/s, 'inf' for "
                        "all at once; with --max-concurrency each rate is capped at each "
                        "concurrency (vLLM's meaning)")
    parser.add_argument("--poisson-rate", default="", metavar="R,..",
                        help="comma-separated Poisson arrival rates run uncapped after the "
                        "other loads, in the same run (tandem's own flag)")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts and the arrivals")


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", metavar="URL",
                        help="an OpenAI-compatible server (tandem, vLLM, SGLang), e.g. "
                        "http://127.0.0.1:8000: only its /v1/completions is measured, nothing "
                        "starts here")
    parser.add_argument("--served-model-name", help="with --base-url: the model name sent "
                        "(default: --model, else the first id of GET /v1/models)")
    parser.add_argument("--api-key", help="with --base-url: sent as 'Authorization: Bearer'")
    parser.add_argument("--client-processes", type=int, default=0, metavar="N",
                        help="HTTP client processes sharing each load (default: one per "
                        "ingress port; 1 with --base-url): one process reading ~10k chunks/s "
                        "is itself the bottleneck")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help=f"catalog name or HF folder (default: {DEFAULT_MODEL}); "
                       "with --base-url: the model name sent")
    model.add_argument("--shape", help="a real architecture with random weights "
                       "(see `tandem bench latency --help`)")


def add_result_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save-result", action="store_true",
                        help="name the JSON as vLLM does, <label>-<rate>qps[-concurrency<c>]-"
                        "<model>-<time>.json, in --result-dir (the JSON is always written)")
    parser.add_argument("--result-dir", help="folder of the vLLM-named JSON (default: the "
                        "current folder)")
    parser.add_argument("--output", help="JSON path (default: bench-results/serve-<time>.json, "
                        "or the vLLM name with --save-result / --result-dir)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw TTFT, TPOT and output "
                        "throughput against the loads (needs matplotlib)")


def add_local_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--dtype", default="auto", help="(default: %(default)s)")
    group.add_argument("--device", default="auto", help="cpu | cuda | auto")
    group.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    group.add_argument("--replicas", type=int, default=1, help="engine replicas")
    group.add_argument("--ingress-replicas", type=int, default=0,
                       help="HTTP ingress replicas in front of the same engines (default: 0, "
                       "auto: 4 on a GPU, 1 on the CPU)")
    group.add_argument("--max-num-seqs", type=int, default=128, help="(default: %(default)s)")
    group.add_argument("--num-kv-blocks", type=int, help="(default: as memory allows)")
    group.add_argument("--decode-steps", type=int, default=0,
                       help="decode steps per call when every request decodes (default: 0, "
                       "auto: 8 on a GPU)")
    group.add_argument("--decode-lookahead", action="store_true",
                       help="multi-step calls also run the next call's first step")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       help="schedule each step while the workers run the one before "
                       "(default: on a GPU, off on the CPU)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="tokens per step at most (default: %(default)s)")
    group.add_argument("--tpot-target-ms", type=float, default=0.0,
                       help="the step's token budget from its measured cost, for this TPOT "
                       "(default: 0, the fixed budget)")


def parse_loads(args: argparse.Namespace) -> list[Load]:
    """Either flag alone: one load a value. Both: every rate capped at every concurrency, as
    vLLM reads the pair. Neither: the default concurrencies. Then --poisson-rate's loads."""
    rates = [float(r) for r in args.request_rate.split(",") if r.strip()]
    poisson = [Load(rate=float(r)) for r in args.poisson_rate.split(",") if r.strip()]
    given = (DEFAULT_CONCURRENCIES if args.concurrency is None and not rates and not poisson
             else args.concurrency)
    caps = [int(c) for c in (given or "").split(",") if c.strip()]
    if rates and caps:
        loads = [Load(concurrency=c, rate=r) for r in rates for c in caps]
    else:
        loads = [Load(concurrency=c) for c in caps] + [Load(rate=r) for r in rates]
    loads += poisson
    if not loads or not all(load.valid for load in loads):
        raise ValueError("give at least one --max-concurrency >= 1 or --request-rate > 0")
    return loads


def serve_bench(args: argparse.Namespace) -> int:
    loads = parse_loads(args)
    check_slo_arguments(args)
    if args.plot:
        from cluster.bench.plots import pyplot

        pyplot()  # a missing matplotlib fails now, not after the run
    if args.base_url:
        return asyncio.run(_bench_base_url(args, loads))
    config = local_config(args)
    # as `tandem serve` runs it, set before the Ray instance below starts (its processes
    # inherit the environment): direct ingress on ports chosen here, measured there
    throughput = environment.set_serve_throughput_optimized(None) == "1"
    ports = free_serve_ports(config.num_ingress_replicas, throughput)
    if throughput:
        environment.set_serve_ports(ports.http[0], config.num_ingress_replicas)
    return asyncio.run(_serve_bench(args, loads, config, ports))


def local_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from cluster.serve.config import load_config

    args.model = args.model or DEFAULT_MODEL
    if args.shape:
        from cluster.bench.shapes import build_random_model
        args.model = str(build_random_model(args.shape, environment.cache_dir() / "bench-models"))
    return load_config({
        "model": args.model, "dtype": args.dtype, "device": args.device,
        "tensor_parallel_size": args.tp, "num_replicas": args.replicas,
        "ingress_replicas": args.ingress_replicas,
        "max_num_seqs": args.max_num_seqs, "num_kv_blocks": args.num_kv_blocks,
        "max_model_len": args.input_len + args.output_len + 16, "api_key": None,
        "decode_steps": args.decode_steps, "decode_lookahead": args.decode_lookahead,
        "async_scheduling": args.async_scheduling,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "tpot_target_ms": args.tpot_target_ms,
    })


def free_serve_ports(num_ingress: int, throughput: bool, tries: int = 50) -> ServePorts:
    """`tandem serve`'s ports (cluster/cli/serve_ports.py) from a first port whose whole
    range is free now, below Ray's and Serve's own ranges."""
    from cluster.cli.serve import check_ports_free

    rng = random.Random()
    for _ in range(tries):
        ports = serve_ports(rng.randrange(20000, 29000), num_ingress, throughput)
        try:
            check_ports_free("127.0.0.1", ports)
        except ValueError:
            continue
        return ports
    raise RuntimeError(f"found no {len(ports.all)} free ports in 20000-29000")


async def _serve_bench(args: argparse.Namespace, loads: list[Load], config,  # type: ignore[no-untyped-def]
                       ports: ServePorts) -> int:
    from ray import serve

    from cluster.bench.report import machine_facts, publish
    from cluster.ray.tandem_cluster import TandemCluster
    from cluster.serve.app import server_app
    from workers.loader import load_config as load_hf_config

    bound = await asyncio.to_thread(measure_bound, args, config)
    init_ray(include_dashboard=False, ignore_reinit_error=True)
    print("in-process: TandemCluster.generate, no HTTP")
    cluster = await asyncio.to_thread(TandemCluster, config.engine_config(), config.num_replicas)
    vocab = min(load_hf_config(cluster.model_path).vocab_size, SAFE_VOCAB)
    send = in_process_sender(cluster)
    in_process = await run_loads(send, args, loads, vocab)
    sweeps = {}
    if args.find_slo_rate:
        sweeps["in-process"] = await sweep("in-process", args, vocab, bound, runner_of(send))
    await asyncio.to_thread(cluster.shutdown)

    urls = [f"http://127.0.0.1:{port}" for port in ports.http]
    processes = args.client_processes or len(urls)
    print(f"http: Ray Serve, OpenAI /v1/completions, streaming, from {processes} client "
          f"process(es) to port(s) {', '.join(str(p) for p in ports.http)}")
    serve.start(http_options={"host": "127.0.0.1", "port": ports.proxy})
    await asyncio.to_thread(serve.run, server_app(config), name="bench", route_prefix="/")
    clients = await asyncio.to_thread(HttpClients, urls, config.model_name, processes)
    try:
        http = await run_loads(None, args, loads, vocab, runner=clients.run)
        if args.find_slo_rate:
            sweeps["http"] = await sweep("http", args, vocab, bound, clients.run)
    finally:
        clients.close()
    record = {"workload": "serve", "config": vars(args) | {"handler": None},
              "environment": machine_facts(_device(config.engine_config().resolved_device)),
              "http_ports": list(ports.http), "client_processes": processes,
              "in_process": in_process, "http": http, "bound": bound, "slo_sweeps": sweeps}
    paths = {"in-process": in_process, "http": http}
    published = publish(record, tables(loads, paths, args, bound, sweeps),
                        result_path(args, "tandem", config.model_name, http))
    if args.plot:
        write_plot(args.plot, paths, sweeps)
    serve.shutdown()  # after the figures are out: it can take Serve tens of seconds
    return 0 if published else 1


# -- any OpenAI-compatible server ---------------------------------------------------------------


async def _bench_base_url(args: argparse.Namespace, loads: list[Load]) -> int:
    from cluster.bench.report import publish

    httpx = httpx_module()
    base_url = api_root(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    processes = args.client_processes or 1
    try:
        async with httpx.AsyncClient(base_url=base_url, headers=headers,
                                     timeout=httpx.Timeout(None, connect=10.0)) as client:
            model = args.served_model_name or args.model or await first_model_id(client)
        print(f"http: {base_url}/v1/completions, model {model}, streaming, from {processes} "
              "client process(es)")
        clients = await asyncio.to_thread(HttpClients, [base_url], model, processes, headers)
        sweeps = {}
        try:
            http = await run_loads(None, args, loads, SAFE_VOCAB, runner=clients.run)
            if args.find_slo_rate:
                sweeps["http"] = await sweep("http", args, SAFE_VOCAB, None, clients.run)
        finally:
            clients.close()
    except (httpx.HTTPError, ClientError) as error:
        raise ValueError(f"--base-url {base_url}: {one_line(error)}") from None
    record = base_url_record(args, base_url, model, http) | {"slo_sweeps": sweeps}
    published = publish(record, tables(loads, {"http": http}, args, None, sweeps),
                        result_path(args, "openai", model, http))
    if args.plot:
        write_plot(args.plot, {model: http}, {model: sweeps["http"]} if sweeps else {})
    return 0 if published else 1


def api_root(url: str) -> str:
    """The server's root: OpenAI clients are often given .../v1, vLLM's --base-url is not."""
    return url.rstrip("/").removesuffix("/v1")


async def first_model_id(client) -> str:  # type: ignore[no-untyped-def]
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models listed no model: give --served-model-name")
    return models[0]["id"]


def one_line(error: Exception) -> str:
    text = str(error).splitlines()
    return text[0] if text else type(error).__name__


def base_url_record(args: argparse.Namespace, base_url: str, model: str,
                    http: dict[str, dict]) -> dict:
    """The result file of a --base-url run: each load's results by load name, and with a single
    load its keys at the top level too, where vLLM's tooling looks for them."""
    record = {"workload": "serve", "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai",
              "base_url": base_url, "model_id": model, "num_prompts": args.num_requests,
              "config": vars(args) | {"handler": None}, "http": http}
    if len(http) == 1:
        record |= next(iter(http.values()))
    return record


def result_path(args: argparse.Namespace, label: str, model: str,
                results: dict[str, dict]) -> str | None:
    """--output, or vLLM's file name in --result-dir; None: publish's default name."""
    if args.output or not (args.save_result or args.result_dir):
        return args.output
    name = result_file_name(label, list(results.values()), model, time.strftime("%Y%m%d-%H%M%S"))
    return str(Path(args.result_dir or ".") / name)


def write_plot(path: str, series: dict[str, dict[str, dict]],
               sweeps: dict[str, dict] | None = None) -> None:
    """The loads to ``path``; each path's sweep beside it (serve_slo.py)."""
    from cluster.bench.plots import plot_loads

    plot_loads(path, series)
    print(f"wrote {path}")
    plot_sweeps(path, sweeps or {})


def tables(loads: list[Load], paths: dict[str, dict], args: argparse.Namespace,
           bound: dict | None, sweeps: dict[str, dict]) -> str:
    """The loads' table; the bound and the sweep's beneath."""
    text = table(loads, paths, goodput_slo(args).text)
    if bound:
        text += (f"\n\nbound of the load: {bound['requests_per_s']:.1f} req/s, "
                 f"{bound['output_tokens_per_s']:.0f} output tok/s")
    if sweeps:
        text += "\n\n" + slo_table(bound, sweeps)
    return text


def _device(name: str):  # type: ignore[no-untyped-def]
    import torch

    return torch.device(name)


def table(loads: list[Load], paths: dict[str, dict], goodput_text: str) -> str:
    """A row a load and path; with two paths, the second's throughput as a share of the first's
    (HTTP / in-process: the cost of serving)."""
    from cluster.bench.report import markdown_table

    header = ["load", "path", "out tok/s", "HTTP / in-proc", "TTFT p50/p99 ms",
              "TPOT p50/p99 ms", "ITL p50/p99 ms", "e2e p50/p99 s",
              f"goodput req/s ({goodput_text})"]

    def ms(stats: dict) -> str:
        return "—" if stats["p50"] is None else f"{stats['p50']*1e3:.1f} / {stats['p99']*1e3:.1f}"

    def s(stats: dict) -> str:
        return "—" if stats["p50"] is None else f"{stats['p50']:.2f} / {stats['p99']:.2f}"

    rows = []
    for load in loads:
        base = next(iter(paths.values()))[load.name]["output_tokens_per_s"]
        for index, (path, results) in enumerate(paths.items()):
            r = results[load.name]
            rows.append([load.name, path, r["output_tokens_per_s"],
                         f"{r['output_tokens_per_s'] / base:.1%}" if index else "",
                         ms(r["ttft_s"]), ms(r["tpot_s"]), ms(r["itl_s"]), s(r["e2e_s"]),
                         r["goodput_requests_per_s"]])
    if len(paths) == 1:  # nothing to compare with: no ratio column
        header, rows = header[:3] + header[4:], [row[:3] + row[4:] for row in rows]
    return markdown_table(header, rows)
