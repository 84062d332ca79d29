"""`tandem bench speculative` — W5: what speculation buys at each batch size, k and acceptance.

Acceptance does not depend on the hardware, and speed does not depend on the weights: on
random weights the benchmark's own proposer sets the acceptance. ``Oracle`` proposes the
tokens the target will emit, each replaced by a wrong one with probability 1 - alpha, so a
draft position j is kept with probability alpha^j. Each row stands beside its theory:
(1 - alpha^(k+1)) / (1 - alpha) tokens per verify step, and that over the measured cost of a
verify step in plain steps.

"The tokens the target will emit" are found by running to a fixed point. In bfloat16 a verify
step's arithmetic is not the plain step's (other matrix shapes sum in another order), and a
random-weight model's top two logits are close, so a run with speculation leaves the plain
run's tokens after ~10 of them, and an oracle of the plain run's tokens would then be wrong
for the rest of the row. So each configuration runs again with the last run's own tokens as
the answers, until a run emits exactly what its oracle knew (a few rounds; the earliest
difference moves later every round). In float32 the first round is already the fixed point.

``--draft-shape`` adds a random draft model of that shape in the target's worker: it drafts
for every row the oracle drafts for (its cost is paid) while the oracle still sets the
acceptance (draft and target are unrelated random models); ``--proposer draft`` takes the
draft's own proposals instead (the target's shape and seed as the draft: the target as its own
draft), ``--proposer ngram`` prompt lookup's (with ``--prompts code`` on a real model: its
acceptance on copy-heavy answers).
"""

import argparse
import random
import time
from pathlib import Path

from cluster.bench.code_prompts import chat_prompts, code_prompts
from cluster.bench.report import markdown_table
from cluster.bench.workloads import latency_prompt
from router.sampling_params import SamplingParams

MAX_ROUNDS = 48  # fixed-point runs per configuration


class Oracle:
    """The benchmark's proposer: the known answer, corrupted at rate 1 - alpha. Whether the
    proposal for a row's position is right is a function of (seed, row, position) alone, so
    a run repeated with the same answers proposes the same drafts."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], alpha: float, vocab: int,
                 seed: int = 0, draft_model: bool = False) -> None:
        """``draft_model``: the engine has one, and it still runs for each row that drafts
        (its cost is the benchmark's), its own drafts set aside for the oracle's."""
        self.answers, self.alpha, self.vocab, self.seed = answers, alpha, vocab, seed
        self.draft_model = draft_model
        self.rows = {prompt: row for row, prompt in enumerate(answers)}

    def right(self, row: int, position: int) -> bool:
        return self.alpha >= 1 or random.Random(f"{self.seed}:{row}:{position}").random() < \
            self.alpha

    def propose(self, seq, num_drafts: int) -> list[int]:  # type: ignore[no-untyped-def]
        prompt = tuple(seq.prompt_token_ids)
        answer, row = self.answers.get(prompt, []), self.rows.get(prompt, -1)
        start = seq.num_output_tokens
        return [t if self.right(row, start + j) else (t + 1) % self.vocab
                for j, t in enumerate(answer[start : start + num_drafts])]

    def ask(self, seq, num_drafts: int) -> None:  # type: ignore[no-untyped-def]
        seq.spec_token_ids = self.propose(seq, num_drafts)
        if self.draft_model:
            seq.num_model_drafts = len(seq.spec_token_ids)


def first_difference(tokens: list[int], plain: list[int]) -> int:
    """The first position where a row left the plain run's tokens (its length if none)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, plain, strict=True)) if a != b),
                len(tokens))


def theory(alpha: float, k: int) -> float:
    """Expected tokens a verify step of k drafts emits."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def timed(llm, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return [out.token_ids for out in outputs], time.perf_counter() - start


def counted(llm, prompts: list[list[int]], output_len: int) -> dict:  # type: ignore[no-untyped-def]
    """One timed run with the speculation counters it moved."""
    per_position = llm.engine.metrics.spec_decode_accepted_per_position  # grows in place
    before, was = llm.stats(), list(per_position)
    costs = llm.engine.speculator.lengths.costs
    calls: list[list[float]] = []  # what adaptive speculation measured, call by call
    add = costs.add

    def recorded(seconds: float, *features: int) -> None:
        calls.append([*features, round(1e3 * seconds, 3)])
        add(seconds, *features)

    costs.add = recorded
    try:
        tokens, seconds = timed(llm, prompts, output_len)
    finally:
        costs.add = add
    after, now = llm.stats(), list(per_position)
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    was += [0] * (len(now) - len(was))
    return {"tokens": tokens, "seconds": seconds, "drafts": drafts,
            "kept_per_position": [b - a for a, b in zip(was, now, strict=True)],
            "draft_tokens": after.spec_decode_num_draft_tokens
            - before.spec_decode_num_draft_tokens,
            "kept": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
            "calls": calls}


def oracle_run(llm, prompts, plain_tokens, alpha: float, vocab: int,  # type: ignore[no-untyped-def]
               output_len: int, repeats: int = 1) -> dict:
    """Runs until the oracle's answers are the run's own tokens (or MAX_ROUNDS). Adaptive
    speculation decides from measured times, which differ run to run, and other decisions
    give other bfloat16 tokens: from the second round on it decides from what the first
    measured (``held_decisions``), so the rounds reach a fixed point as fixed k does."""
    speculator = llm.engine.speculator
    answers = {tuple(p): t for p, t in zip(prompts, plain_tokens, strict=True)}
    held = HeldDecisions(speculator.lengths) if speculator.lengths.adaptive else None
    try:
        for rounds in range(1, MAX_ROUNDS + 1):
            speculator.proposer = Oracle(answers, alpha, vocab,
                                         draft_model=speculator.draft_model is not None)
            run = counted(llm, prompts, output_len)
            if held is not None:
                held.hold_costs()  # as the first round measured them
                held.restore()
            if run["tokens"] == list(answers.values()):
                for _ in range(repeats - 1):  # the same decisions again: the fastest counts
                    again = counted(llm, prompts, output_len)
                    if held is not None:
                        held.restore()
                    if again["seconds"] < run["seconds"]:
                        run |= again
                return run | {"rounds": rounds, "fixed_point": True}
            answers = {tuple(p): t for p, t in zip(prompts, run["tokens"], strict=True)}
        return run | {"rounds": MAX_ROUNDS, "fixed_point": False}
    finally:
        if held is not None:
            held.release()


class HeldDecisions:
    """Adaptive speculation's state, held: what a run learns of acceptance (the draft's pooled
    acceptance, the proposer's time, the step clock) is put back after each run, so every
    round starts where the first did (a round whose oracle still errs would otherwise teach
    the next that the draft is bad), and the fitted costs are held as the first round left
    them. With the fit held there is nothing for a plain probe to measure: none is made (a fit
    of mostly verify calls would otherwise probe at every step)."""

    def __init__(self, lengths) -> None:  # type: ignore[no-untyped-def]
        self.lengths, costs = lengths, lengths.costs
        self.state = (lengths.pool_alpha, lengths.pool_weight, lengths.proposer_seconds,
                      lengths.steps)
        self.add, self.fit, self.plain = costs.add, costs.fit, costs.plain
        self.held = False

    def hold_costs(self) -> None:
        if self.held:
            return
        costs, fitted = self.lengths.costs, self.lengths.costs.fit()
        costs.add = lambda *args, **kwargs: None
        costs.fit = lambda: fitted
        self.plain, costs.plain, self.held = costs.plain, 1.0, True

    def restore(self) -> None:
        lengths = self.lengths
        (lengths.pool_alpha, lengths.pool_weight, lengths.proposer_seconds,
         lengths.steps) = self.state

    def release(self) -> None:
        costs = self.lengths.costs
        costs.add, costs.fit, costs.plain = self.add, self.fit, self.plain


def plain_runs(setup, batches: list[int], args) -> dict[int, tuple[list, list, float]]:  # type: ignore[no-untyped-def]
    """Per batch size: prompts, tokens and seconds of the target alone (no speculation)."""
    from cluster.bench.engine_runs import release

    llm = setup.engine()
    runs = {}
    for batch in batches:
        if args.prompts == "code":
            prompts = code_prompts(Path(setup.folder), batch)
        elif args.prompts == "chat":
            prompts = chat_prompts(Path(setup.folder), batch)
        else:
            prompts = [latency_prompt(args.input_len, setup.vocab_size, seed=s)
                       for s in range(batch)]
        timed(llm, prompts, min(32, args.output_len))  # warm-up: graphs, compiles
        tokens, seconds = timed(llm, prompts, args.output_len)
        for _ in range(args.repeats - 1):  # the fastest of the repeats: the least disturbed
            seconds = min(seconds, timed(llm, prompts, args.output_len)[1])
        runs[batch] = (prompts, tokens, seconds)
    release(llm)
    return runs


def speculative_engine(setup, args):  # type: ignore[no-untyped-def]
    config: dict = {"num_speculative_tokens": max(args.k), "adaptive": args.adaptive}
    if args.eagle3_head:
        from cluster.bench.eagle_head_shapes import build_random_eagle3_head

        config |= {"method": "eagle3", "model": str(build_random_eagle3_head(
            Path(setup.folder)))}
    elif args.draft_model is not None:
        config["model"] = args.draft_model
    elif args.draft_shape is None:
        config["method"] = "ngram"  # replaced by the oracle: only its slot in the engine counts
    else:
        from cluster.bench.shapes import build_random_model

        seed = args.draft_seed if args.draft_seed is not None else (
            0 if args.draft_shape == args.shape else 1)
        config["model"] = str(build_random_model(args.draft_shape, Path(setup.folder).parent,
                                                 seed=seed))
    return setup.engine(speculative_config=config)


def set_draft_length(llm, k: int) -> None:  # type: ignore[no-untyped-def]
    """k drafts a step: the scheduler's, and the draft model's (it drafts as many as asked)."""
    llm.engine.speculator.lengths.max_drafts = k


def modes(args: argparse.Namespace) -> list[tuple[bool, int]]:
    """(adaptive, k) runs of one configuration: each k as asked, or with ``--beside-fixed``
    every fixed k and then adaptive up to the largest."""
    if args.beside_fixed:
        return [(False, k) for k in args.k] + [(True, max(args.k))]
    return [(args.adaptive, k) for k in args.k]


def adaptive_against_fixed(results: list[dict]) -> str:
    """Per batch and acceptance: adaptive's speedup over the better of no speculation (1.0)
    and the best fixed k, the issue's measure of a choice that never loses."""
    rows = []
    for run in (r for r in results if r["adaptive"]):
        fixed = [r for r in results if not r["adaptive"] and r["batch"] == run["batch"]
                 and r["alpha"] == run["alpha"]]
        best = max(fixed, key=lambda r: r["speedup"])
        better = max(1.0, best["speedup"])
        rows.append([run["batch"], run["alpha"], best["k"], best["speedup"], run["speedup"],
                     run["speedup"] / better])
    return markdown_table(["batch", "alpha", "best fixed k", "its speedup", "adaptive speedup",
                           "adaptive / better of plain and best fixed"], rows)


def fitted_costs_ms(llm) -> list[float] | None:  # type: ignore[no-untyped-def]
    """What adaptive speculation believes a call costs (router/speculation.py): the step, a
    token, a verify call, a draft step, a draft token, a catch-up token, in ms."""
    fitted = llm.engine.speculator.lengths.costs.fit()
    return None if fitted is None else [round(1e3 * value, 4) for value in fitted]


def run_speculative(args: argparse.Namespace) -> int:
    from cluster.bench.commands import Setup
    from cluster.bench.report import publish

    has_draft = args.draft_shape is not None or args.draft_model is not None or \
        args.eagle3_head
    if args.proposer == "draft" and not has_draft:
        raise SystemExit("--proposer draft needs --draft-shape or --draft-model")
    if args.proposer == "ngram" and has_draft:
        raise SystemExit("--proposer ngram runs without a draft model")
    setup = Setup(args)
    plain = plain_runs(setup, args.batch_sizes, args)
    llm = speculative_engine(setup, args)
    alphas = [None] if args.proposer != "oracle" else args.alpha
    rows, results = [], []
    for batch in args.batch_sizes:
        prompts, plain_tokens, plain_s = plain[batch]
        timed(llm, prompts, min(32, args.output_len))  # warm-up of this engine
        plain_step = plain_s / args.output_len
        for alpha in alphas:
            for adaptive, k in modes(args):
                llm.engine.speculator.lengths.adaptive = adaptive
                set_draft_length(llm, k)
                if alpha is None:
                    run = counted(llm, prompts, args.output_len) | {"rounds": 1,
                                                                    "fixed_point": True}
                    for _ in range(args.repeats - 1):  # the fastest counts
                        again = counted(llm, prompts, args.output_len)
                        if again["seconds"] < run["seconds"]:
                            run |= again
                else:
                    run = oracle_run(llm, prompts, plain_tokens, alpha, setup.vocab_size,
                                     args.output_len, args.repeats)
                drafts = max(run["drafts"], 1)
                measured_alpha = run["kept"] / max(run["draft_tokens"], 1)
                a = alpha if alpha is not None else measured_alpha
                per_step = (run["drafts"] + run["kept"]) / drafts
                step_cost = run["seconds"] / (drafts / batch) / plain_step  # in plain steps
                left = sorted(first_difference(t, p)
                              for t, p in zip(run["tokens"], plain_tokens, strict=True))
                result = {"batch": batch, "alpha": alpha, "measured_alpha": measured_alpha,
                          "k": k, "adaptive": adaptive, "seconds": run["seconds"],
                          "plain_seconds": plain_s,
                          "speedup": plain_s / run["seconds"], "tokens_per_verify": per_step,
                          "theory": theory(a, k), "verify_step_in_plain_steps": step_cost,
                          "theory_speedup": theory(a, k) / step_cost,
                          "verify_steps": run["drafts"],
                          "kept_per_position": run["kept_per_position"][:k],
                          "rounds": run["rounds"], "fixed_point": run["fixed_point"],
                          "fitted_costs_ms": fitted_costs_ms(llm),
                          # decode calls: steps, tokens, draft steps, draft tokens, ms
                          "calls": run["calls"],
                          "rows_equal_to_plain": sum(x == len(t) for x, t in
                                                     zip(left, run["tokens"], strict=True)),
                          "first_difference": left}
                results.append(result)
                rows.append([batch, alpha if alpha is not None else f"{measured_alpha:.2f}",
                             f"≤ {k}" if adaptive else k,
                             per_step, theory(a, k), step_cost, plain_s / run["seconds"],
                             theory(a, k) / step_cost, run["rounds"],
                             f"{result['rows_equal_to_plain']}/{batch}"])
                print(f"  batch {batch} alpha {alpha} k {'<= ' if adaptive else ''}{k}: "
                      f"{plain_s / run['seconds']:.2f}x "
                      f"({run['rounds']} rounds; the engine's fitted costs a, b, g, h: "
                      f"{result['fitted_costs_ms']} ms)", flush=True)
    table = markdown_table(["batch", "alpha", "k", "tokens / verify", "theory",
                            "verify step (plain steps)", "speedup", "theory speedup",
                            "rounds", "rows as plain"], rows)
    if args.beside_fixed:
        table += "\n\n" + adaptive_against_fixed(results)
    publish(setup.record | {"workload": "speculative",
                            "draft": args.draft_model or args.draft_shape or (
                                "eagle3-random" if args.eagle3_head else None),
                            "results": results}, table, args.output)
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
    parser.add_argument("--prompts", choices=["random", "code", "chat"], default="random",
                        help="random token ids (--input-len), code to edit, or the questions "
                        "`tandem draft-head train` holds out, in the model's chat template "
                        "(real models: cluster/bench/code_prompts.py)")
    parser.add_argument("--draft-shape", help="a random draft model of this shape in the "
                        "target's worker (its cost paid; the oracle still proposes)")
    parser.add_argument("--draft-model", help="a draft model folder instead of --draft-shape")
    parser.add_argument("--eagle3-head", action="store_true",
                        help="a random EAGLE-3 head of the published shape for the target "
                        "(its cost paid; the oracle still proposes; with --proposer draft, "
                        "its own drafts)")
    parser.add_argument("--draft-seed", type=int,
                        help="the draft's weights (default: the target's when the shapes match)")
    parser.add_argument("--proposer", choices=["oracle", "draft", "ngram"], default="oracle",
                        help="who proposes: the benchmark's oracle at each --alpha, the draft "
                        "model, or prompt lookup (their own acceptance, measured)")
    parser.add_argument("--adaptive", action="store_true",
                        help="the engine chooses each row's drafts from measured costs and "
                        "acceptance (router/speculation.py), up to k; default: k every step")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of each configuration (and of plain): the fastest "
                        "counts (one engine's runs differ by a few percent on a GPU)")
    parser.add_argument("--beside-fixed", action="store_true",
                        help="every fixed --k, then adaptive up to the largest, in one engine, "
                        "with adaptive against the better of plain and the best fixed k")
    parser.set_defaults(handler=run_speculative)
