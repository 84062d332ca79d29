"""`tandem bench structured` (issue 41): every row under a JSON schema against the same rows
unconstrained, the TTFT a cached grammar adds, and cold compiles of the test corpus.

The unconstrained run decodes exactly as many tokens per row as the constrained one did
(``ignore_eos``), so the two runs do the same work and their rates compare. A ``--shape``
folder has no tokenizer (prompts are token ids), but a grammar needs one: the shape's weights
are given ``--tokenizer``'s files in a folder beside it (a vocabulary smaller than the shape's
leaves its last ids masked)."""

import argparse
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

# the engine's modules load when a benchmark runs, not when the CLI parses its arguments
if TYPE_CHECKING:
    from router.sampling_params import SamplingParams

# a long answer whatever the weights: at least MIN_ITEMS numbers before the array may close
MIN_ITEMS = 64
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
               "minItems": MIN_ITEMS}},
    "required": ["name", "values"]}
EXTRA_TOKENIZER_FILES = ("chat_template.jinja", "special_tokens_map.json")


def with_tokenizer(folder: Path, tokenizer_folder: Path) -> Path:
    """``folder``'s model with ``tokenizer_folder``'s tokenizer: a folder beside it whose
    weights and config are links, made once."""
    from cluster.engine.tokenizer import TOKENIZER_FILES

    target = folder.parent / f"{folder.name}-tokenizer-{tokenizer_folder.name}"
    if (target / "config.json").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.name != "config.json" and not (target / path.name).exists():
            (target / path.name).symlink_to(path.resolve())
    for name in TOKENIZER_FILES + EXTRA_TOKENIZER_FILES:
        if (tokenizer_folder / name).exists():
            shutil.copyfile(tokenizer_folder / name, target / name)
    shutil.copyfile(folder / "config.json", target / "config.json")  # last: it is complete
    return target


def constrained(max_tokens: int) -> "SamplingParams":
    from router.sampling_params import SamplingParams
    from router.structured_outputs import StructuredOutputs

    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputs(json=SCHEMA))


def timed(llm, prompts: list[list[int]], params: list["SamplingParams"]) -> tuple[list, float]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return outputs, time.perf_counter() - start


def valid_answers(outputs) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(answers that ended, of which parse as JSON with the schema's required fields)."""
    ended = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    valid = 0
    for text in ended:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        values = value.get("values") if isinstance(value, dict) else None
        valid += isinstance(values, list) and len(values) >= MIN_ITEMS and "name" in value
    return len(ended), valid


def batch_run(llm, prompts: list[list[int]], output_len: int, repeats: int) -> dict:  # type: ignore[no-untyped-def]
    """The constrained rows, then the same rows unconstrained for as many tokens each; the
    fastest of ``repeats`` runs of each counts."""
    from router.sampling_params import SamplingParams

    best_structured = best_plain = float("inf")
    for _ in range(repeats):
        outputs, seconds = timed(llm, prompts, [constrained(output_len)] * len(prompts))
        best_structured = min(best_structured, seconds)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        plain_outputs, seconds = timed(llm, prompts, plain)
        best_plain = min(best_plain, seconds)
        assert [len(o.outputs[0].token_ids) for o in plain_outputs] == lengths
    tokens = sum(lengths)
    ended, valid = valid_answers(outputs)
    return {"batch": len(prompts), "output_tokens": tokens,
            "plain_tokens_per_s": tokens / best_plain,
            "structured_tokens_per_s": tokens / best_structured,
            "ratio": best_plain / best_structured, "answers_ended": ended,
            "answers_valid": valid, "first_answer": outputs[0].outputs[0].text[:200]}


def ttft_added(llm, prompts: list[list[int]]) -> dict:  # type: ignore[no-untyped-def]
    """Batch 1, one token: each prompt alone unconstrained and (another prompt) under the
    schema, whose grammar is cached by then; medians and their difference."""
    from router.sampling_params import SamplingParams

    plain, structured = [], []
    for index, prompt in enumerate(prompts):
        params = constrained(1) if index % 2 else SamplingParams(temperature=0.0, max_tokens=1)
        (out,) = llm.generate([prompt], [params])
        (structured if index % 2 else plain).append(out.metrics.ttft)
    return {"plain_ms": 1e3 * statistics.median(plain),
            "structured_ms": 1e3 * statistics.median(structured),
            "added_ms": 1e3 * (statistics.median(structured) - statistics.median(plain)),
            "samples": len(prompts) // 2}


def cold_compiles(folder: Path, vocab_size: int) -> dict:
    """Each spec of the test corpus compiled by a compiler with an empty cache."""
    from cluster.bench.engine_runs import percentiles
    from cluster.bench.structured_corpus import corpus
    from cluster.engine.tokenizer import eos_token_ids, load_tokenizer
    from workers.structured.backend import GrammarCompiler

    tokenizer = load_tokenizer(folder)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, sorted(eos_token_ids(folder, tokenizer)),
                               folder)
    tables_s = time.perf_counter() - start
    seconds = []
    for spec in corpus():
        start = time.perf_counter()
        compiler.compile(spec)
        seconds.append(time.perf_counter() - start)
    ms = {key: None if value is None else 1e3 * value
          for key, value in percentiles(seconds).items()}
    return {"tokenizer_tables_s": tables_s, "specs": len(seconds), "compile_ms": ms}


def run_structured(args: argparse.Namespace) -> int:
    from cluster import environment
    from cluster.bench.commands import Setup
    from cluster.bench.engine_runs import release
    from cluster.bench.report import markdown_table, publish
    from cluster.engine.config import DEFAULT_MODEL
    from cluster.engine.tokenizer import load_tokenizer

    setup = Setup(args)
    if load_tokenizer(setup.folder) is None:
        tokenizer_folder = Path(args.tokenizer) if args.tokenizer else None
        if tokenizer_folder is None:
            from workers.catalog import resolve_model

            tokenizer_folder = resolve_model(DEFAULT_MODEL, environment.cache_dir())
        setup.folder = with_tokenizer(Path(setup.folder), tokenizer_folder)
    vocab = min(setup.vocab_size, len(load_tokenizer(setup.folder)))  # type: ignore[arg-type]
    rng = random.Random(args.seed)
    llm = setup.engine(max_num_seqs=max(args.max_num_seqs, *args.batch_sizes))
    results = []
    for batch in args.batch_sizes:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        batch_run(llm, prompts, min(16, args.output_len), 1)  # warm: the grammar, the graphs
        results.append(batch_run(llm, prompts, args.output_len, args.repeats))
        print(f"batch {batch}: {results[-1]['ratio']:.3f}x of unconstrained")
    ttft_prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                    for _ in range(2 * args.ttft_samples + 2)]
    ttft_added(llm, ttft_prompts[:2])  # warm
    ttft = ttft_added(llm, ttft_prompts[2:])
    release(llm)
    compiles = cold_compiles(Path(setup.folder), setup.hf_config.vocab_size)
    setup.record |= {"workload": "structured", "schema": SCHEMA, "results": results,
                     "ttft": ttft, "cold_compiles": compiles}
    table = markdown_table(
        ["batch", "output tokens", "unconstrained tok/s", "JSON schema tok/s", "ratio",
         "answers ended / valid"],
        [[r["batch"], r["output_tokens"], r["plain_tokens_per_s"], r["structured_tokens_per_s"],
          f"{r['ratio']:.3f}", f"{r['answers_ended']} / {r['answers_valid']}"] for r in results])
    table += (f"\n\nTTFT at batch 1 (median of {ttft['samples']}): {ttft['plain_ms']:.2f} ms "
              f"unconstrained, {ttft['structured_ms']:.2f} ms with a cached grammar "
              f"({ttft['added_ms']:+.2f} ms)\ncold compiles of the test corpus "
              f"({compiles['specs']} specs): p50 {compiles['compile_ms']['p50']:.2f} ms, "
              f"p99 {compiles['compile_ms']['p99']:.2f} ms; tokenizer tables "
              f"{compiles['tokenizer_tables_s']:.2f} s")
    publish(setup.record, table, args.output)
    return 0


def add_structured_parser(workloads: argparse._SubParsersAction,
                          common_arguments) -> None:  # type: ignore[no-untyped-def]
    parser = workloads.add_parser("structured", help="structured outputs: rows under a JSON "
                                  "schema against the same rows unconstrained")
    common_arguments(parser)

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser.add_argument("--batch-sizes", type=ints, default=[32, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of each batch: the fastest counts")
    parser.add_argument("--ttft-samples", type=int, default=20,
                        help="batch-1 requests of each kind for the TTFT a cached grammar adds")
    parser.add_argument("--tokenizer", help="a folder whose tokenizer a --shape model gets "
                        "(default: the default model's)")
    parser.set_defaults(handler=run_structured)
