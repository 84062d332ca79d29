"""`tandem generate`: offline generation from the command line."""

import argparse
import json

from cluster.engine.config import DEFAULT_MODEL


def add_generate_command(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="generate text offline, without a server")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="catalog name or model folder")
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt (repeat for a batch); with --token-ids, comma-separated ids")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--token-ids", action="store_true", help="prompts are token ids")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--device", default="auto", help="auto (cuda when present, else cpu) | "
                     "cpu | cuda | cuda:N")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel size (uses Ray)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    gen.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from cluster.engine.llm import LLM
    from router.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=args.tp)
    if args.token_ids:
        prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
        outputs = llm.generate(prompts, params)
    elif args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outputs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason,
                              "ttft_s": out.metrics.ttft}))
        else:
            print(out.text)
    return 0
