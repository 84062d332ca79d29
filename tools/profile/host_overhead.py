"""Host time per engine step, with the model taken out: `python -m tools.profile.host_overhead`.

On a GPU a decode step of a small model takes a few milliseconds, so the Python around it
(scheduler, KV bookkeeping, step messages, outputs) decides throughput. This harness runs a
real ``LLMEngine`` over a fake executor that answers every step at once with a fixed token,
so what is timed is host work only: the engine's (``engine``) and the worker's input building
(``worker``: request states and the flat input arrays, as ``workers/worker.py`` does them).
The model folder holds a config only (no weights, no tokenizer, so no text).
"""

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cluster.bench.shapes import COMMON, SHAPES
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from router.sampling_params import SamplingParams
from workers.input_batch import build_decode_rows, build_input_batch
from workers.request_state import RequestState
from workers.step_input import StepInput, StepOutput

TOKEN = 7  # what the fake model samples, always


class FakeExecutor:
    """The Executor protocol, answered instantly; keeps request states like a worker does."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.states: dict[str, RequestState] = {}
        self.worker_seconds: list[float] = []
        self.steps_run: list[int] = []  # decode steps each call stood for

    def determine_num_kv_blocks(self) -> int:
        return self.num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def key_centers_digest(self) -> None:
        return None  # a bf16 cache: no int8 key centers

    def device_stats(self) -> list:
        return []

    def execute(self, step: StepInput) -> StepOutput:
        start = time.perf_counter()
        for request_id in step.released_ids:
            self.states.pop(request_id, None)
        for request in step.new_requests:
            self.states[request.request_id] = RequestState.from_new(request, torch.device("cpu"))
        for item in step.scheduled:
            self.states[item.request_id].apply(item)
        rows = build_decode_rows(step.scheduled, self.states, self.block_size)
        if rows is not None:
            sampled = rows.request_ids
        elif step.scheduled:
            batch = build_input_batch(step.scheduled, self.states, self.block_size,
                                      torch.device("cpu"))
            sampled = batch.sample_request_ids
        else:
            sampled = []
        self.worker_seconds.append(time.perf_counter() - start)
        self.steps_run.append(step.num_steps)
        return StepOutput(list(sampled), [[TOKEN] * step.num_steps for _ in sampled])

    def shutdown(self) -> None:
        self.states.clear()


def config_only_folder(root: Path, shape: str = "qwen3-0.6b") -> Path:
    """A model folder with the shape's config.json and no weights: the fake executor never
    loads them, and the engine reads only the config."""
    folder = root / f"{shape}-config-only"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**SHAPES[shape], **COMMON}))
    return folder


def run(args: argparse.Namespace, folder: Path) -> dict:
    blocks_per_seq = -(-(args.prompt_len + args.output_len) // args.block_size)
    num_blocks = args.num_requests * blocks_per_seq + 64
    config = EngineConfig(
        model=str(folder), device="cpu", block_size=args.block_size, num_kv_blocks=num_blocks,
        max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.output_len + 1, decode_steps=args.decode_steps,
    )
    executor = FakeExecutor(num_blocks, args.block_size)
    engine = LLMEngine(config, executor=executor)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vocab = engine.vocab_size
    for index in range(args.num_requests):
        prompt = [(index * 131 + t * 7) % vocab for t in range(args.prompt_len)]
        engine.add_request(prompt, params)
    step = {"full": engine.step, "final": lambda: engine.step(only_finished=True),
            "delta": lambda: engine.step_deltas()}[args.outputs]
    step_seconds, batch_sizes = [], []
    profiler = cProfile.Profile() if args.profile else None
    while engine.has_unfinished():
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        step()
        if profiler:
            profiler.disable()
        step_seconds.append(time.perf_counter() - start)
        batch_sizes.append(engine.metrics.batch_size)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    full = [i for i, b in enumerate(batch_sizes) if b == args.num_requests]
    # per decode step of the model: a call that ran k steps counts as k
    per_step = [executor.steps_run[i] for i in full]
    total = [step_seconds[i] * 1e3 / k for i, k in zip(full, per_step, strict=True)]
    worker = [executor.worker_seconds[i] * 1e3 / k for i, k in zip(full, per_step, strict=True)]
    return {
        "num_calls": len(step_seconds), f"calls_at_batch_{args.num_requests}": len(full),
        "decode_steps": args.decode_steps,
        "host_ms_per_step_p50": statistics.median(total),
        "worker_ms_per_step_p50": statistics.median(worker),
        "engine_ms_per_step_p50": statistics.median(
            t - w for t, w in zip(total, worker, strict=True)),
        "total_seconds": sum(step_seconds), "outputs": args.outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--outputs", choices=["full", "final", "delta"], default="delta",
                        help="what each step returns: every advanced request's whole output "
                        "(engine.step()), finished ones only (as LLM.generate), or deltas "
                        "(engine.step_deltas(), as a streaming replica)")
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="decode steps per engine call (the engine's decode_steps)")
    parser.add_argument("--model", help="a model folder (default: a tiny random qwen3)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile the steps and print the top N functions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folder = Path(args.model) if args.model else config_only_folder(Path(root))
        print(json.dumps(run(args, folder), indent=1))


if __name__ == "__main__":
    main()
