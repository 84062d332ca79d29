"""`tandem bench speculative` — W5: what speculation buys at each batch size, k and acceptance.

Acceptance does not depend on the hardware, and speed does not depend on the weights: on
random weights the benchmark's own proposer sets the acceptance. ``Oracle`` proposes the
tokens the target will emit (known from a plain run first), each replaced by a wrong one with
probability 1 - alpha, so a draft position j is kept with probability alpha^j. Each row stands
beside its theory: (1 - alpha^(k+1)) / (1 - alpha) tokens per verify step.
"""

import argparse
import random
import time

from cluster.bench.report import markdown_table
from cluster.bench.workloads import latency_prompt
from router.sampling_params import SamplingParams


class Oracle:
    """The benchmark's proposer: the known answer, corrupted at rate 1 - alpha (seeded)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], alpha: float, vocab: int,
                 seed: int = 0) -> None:
        self.answers, self.alpha, self.vocab = answers, alpha, vocab
        self.rng = random.Random(seed)

    def propose(self, seq, num_drafts: int) -> list[int]:  # type: ignore[no-untyped-def]
        answer = self.answers.get(tuple(seq.prompt_token_ids), [])
        start = seq.num_output_tokens
        return [t if self.rng.random() < self.alpha else (t + 1) % self.vocab
                for t in answer[start : start + num_drafts]]


def theory(alpha: float, k: int) -> float:
    """Expected tokens a verify step of k drafts emits."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def timed(llm, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return [out.token_ids for out in outputs], time.perf_counter() - start


def run_speculative(args: argparse.Namespace) -> int:
    from cluster.bench.commands import Setup
    from cluster.bench.report import publish

    setup = Setup(args)
    llm = setup.engine(speculative_config={"method": "ngram", "adaptive": False,
                                           "num_speculative_tokens": max(args.k)})
    speculator = llm.engine.speculator
    rows, results = [], []
    for batch in args.batch_sizes:
        prompts = [latency_prompt(args.input_len, setup.vocab_size, seed=s) for s in range(batch)]
        speculator.proposer = Oracle({}, 0.0, setup.vocab_size)  # proposes nothing: plain
        timed(llm, prompts, min(32, args.output_len))  # warm-up: graphs, compiles
        plain_tokens, plain_s = timed(llm, prompts, args.output_len)
        answers = {tuple(p): t for p, t in zip(prompts, plain_tokens, strict=True)}
        for alpha in args.alpha:
            for k in args.k:
                speculator.lengths.max_drafts = k
                speculator.proposer = Oracle(answers, alpha, setup.vocab_size)
                before = llm.stats()
                tokens, seconds = timed(llm, prompts, args.output_len)
                after = llm.stats()
                drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
                kept = (after.spec_decode_num_accepted_tokens
                        - before.spec_decode_num_accepted_tokens)
                per_step = (drafts + kept) / max(drafts, 1)
                same = sum(a == b for a, b in zip(tokens, plain_tokens, strict=True))
                result = {"batch": batch, "alpha": alpha, "k": k, "seconds": seconds,
                          "plain_seconds": plain_s, "speedup": plain_s / seconds,
                          "tokens_per_verify": per_step, "theory": theory(alpha, k),
                          "rows_equal_to_plain": same}
                results.append(result)
                rows.append([batch, alpha, k, per_step, theory(alpha, k), plain_s / seconds,
                             f"{same}/{batch}"])
                print(f"  batch {batch} alpha {alpha} k {k}: {plain_s / seconds:.2f}x", flush=True)
    table = markdown_table(["batch", "alpha", "k", "tokens / verify", "theory", "speedup",
                            "same tokens as plain"], rows)
    publish(setup.record | {"workload": "speculative", "results": results}, table, args.output)
    return 0


def add_speculative_parser(workloads: argparse._SubParsersAction,
                           common_arguments) -> None:  # type: ignore[no-untyped-def]
    parser = workloads.add_parser("speculative", help="W5: speculative decoding by batch, k "
                                  "and acceptance (the benchmark's proposer sets it)")
    common_arguments(parser)

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",")]

    parser.add_argument("--batch-sizes", type=ints, default=[1, 4, 8])
    parser.add_argument("--k", type=ints, default=[2, 3, 4, 5], help="drafts per verify step")
    parser.add_argument("--alpha", type=floats, default=[1.0, 0.8, 0.6],
                        help="the share of right drafts the proposer makes")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.set_defaults(handler=run_speculative)
