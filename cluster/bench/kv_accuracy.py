"""`tandem bench kv-accuracy`: what a quantized KV cache costs in accuracy, measured.

A fixed text set (cluster/bench/kv_texts.py) runs through tandem's own model under teacher
forcing, once with the KV cache in the model's dtype and once per quantized format. Each text
is one prefill step over a fresh paged cache: the step stores every token's K and V first and
attends over the cache, so every key and value a position sees was quantized and read back, as
in decode steps. Per format it reports:

- top-1 agreement: the share of positions whose next-token argmax is the unquantized cache's;
- the perplexity of the texts' real next tokens with either cache, and their ratio;
- the mean KL divergence from the unquantized next-token distribution.

Then, with ``--chat-prompts``, greedy answers to fixed chat questions through the engine with
either cache: how many come out identical, and how far the others agree.

A model folder without tokenizer files (the tests' tiny models) gets seeded random token ids
of the texts' lengths instead.
"""

import argparse
import math

import torch

from cluster import environment
from cluster.bench.engine_runs import make_llm, release
from cluster.bench.kv_texts import CHAT_QUESTIONS, TEXTS
from cluster.bench.report import machine_facts, markdown_table, publish
from cluster.engine.tokenizer import load_tokenizer
from router.sampling_params import SamplingParams
from workers.attention.key_centers import key_centers_for
from workers.attention.metadata import whole_sequence
from workers.catalog import resolve_model
from workers.kv_cache import allocate_kv_caches, dtype_name, resolve_kv_format
from workers.layers.parallel import TensorParallelGroup
from workers.loader import load_model
from workers.worker_config import DTYPES, make_attention_backend

RANDOM_TEXT_TOKENS = 200  # per text, for a model without a tokenizer


def text_token_ids(folder, vocab_size: int, max_tokens: int, seed: int) -> list[list[int]]:
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (min(RANDOM_TEXT_TOKENS, max_tokens),),
                              generator=generator).tolist() for _ in TEXTS]
    return [tokenizer.encode(text)[:max_tokens] for text in TEXTS]


@torch.inference_mode()
def teacher_forced_log_probs(model, hf_config, token_ids: list[int], kv_format, dtype,
                             device: torch.device, block_size: int,
                             key_centers: list[torch.Tensor] | None = None) -> torch.Tensor:
    """(T - 1, vocab) float32 log-probabilities of the next token at every position but the
    last, through a fresh cache in ``kv_format`` (keys less ``key_centers``, if it centers
    them: workers/attention/key_centers.py)."""
    num_tokens = len(token_ids)
    caches = allocate_kv_caches(hf_config, 1, -(-num_tokens // block_size), block_size, dtype,
                                device, kv_format, key_centers)
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), caches,
                   whole_sequence(num_tokens, block_size, device))
    logits = model.compute_logits(hidden[:-1]).float()
    return torch.log_softmax(logits, dim=-1)


def compare(reference: list[torch.Tensor], quantized: list[torch.Tensor],
            texts: list[list[int]]) -> dict:
    """Agreement, perplexities and KL over every scored position of every text."""
    same = nll_ref = nll_q = kl = 0.0
    count = 0
    for ref, q, ids in zip(reference, quantized, texts, strict=True):
        targets = torch.tensor(ids[1:], device=ref.device)[:, None]
        same += (ref.argmax(-1) == q.argmax(-1)).sum().item()
        nll_ref -= ref.gather(1, targets).sum().item()
        nll_q -= q.gather(1, targets).sum().item()
        kl += (ref.exp() * (ref - q)).sum().item()
        count += len(ids) - 1
    ppl_ref, ppl_q = math.exp(nll_ref / count), math.exp(nll_q / count)
    return {"positions": count, "top1_agreement": same / count, "perplexity_reference": ppl_ref,
            "perplexity_quantized": ppl_q, "perplexity_ratio": ppl_q / ppl_ref,
            "mean_kl_nats": kl / count}


def greedy_answers(folder, args: argparse.Namespace, device: str, dtype: str,
                   kv_cache_dtype: str) -> tuple[list[list[int]], list[str]]:
    """Each chat question's greedy answer with this cache: its token ids and its text (the
    text empty without a tokenizer)."""
    llm = make_llm(folder, dtype=dtype, device=device, block_size=args.block_size,
                   kv_cache_dtype=kv_cache_dtype, attention_backend=args.attention_backend,
                   num_kv_blocks=args.chat_kv_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=args.chat_tokens)
    questions = CHAT_QUESTIONS[: args.chat_prompts]
    if llm.engine.tokenizer is not None:
        outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    else:  # no chat template without a tokenizer: the questions' bytes as token ids
        vocab = llm.engine.vocab_size
        outputs = llm.generate([[b % vocab for b in q.encode()] for q in questions], params)
    release(llm)
    return ([out.outputs[0].token_ids for out in outputs],
            [out.outputs[0].text or "" for out in outputs])


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def answer_agreement(reference: list[list[int]], quantized: list[list[int]]) -> dict:
    prefixes = [common_prefix(r, q) for r, q in zip(reference, quantized, strict=True)]
    identical = sum(r == q for r, q in zip(reference, quantized, strict=True))
    return {"answers": len(reference), "identical": identical,
            "mean_common_prefix_tokens": sum(prefixes) / max(1, len(prefixes))}


def kv_accuracy(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    folder = resolve_model(args.model, environment.cache_dir())
    formats = {name: resolve_kv_format(name, dtype, device) for name in ["auto", *args.formats]}
    backend = make_attention_backend(args.attention_backend, device)
    model, hf_config = load_model(folder, dtype, device, TensorParallelGroup.single(), backend)
    texts = text_token_ids(folder, hf_config.vocab_size, args.max_tokens_per_text, args.seed)
    single = TensorParallelGroup.single()
    centers = {name: key_centers_for(fmt, model, hf_config, single, dtype, device)
               for name, fmt in formats.items()}  # calibrated as an engine would at start-up
    log_probs = {name: [teacher_forced_log_probs(model, hf_config, ids, fmt, dtype, device,
                                                 args.block_size, centers[name])
                        for ids in texts]
                 for name, fmt in formats.items()}
    del model
    results = {name: compare(log_probs["auto"], log_probs[name], texts) for name in args.formats}
    if args.chat_prompts:
        answers = {name: greedy_answers(folder, args, str(device), dtype_name(dtype), name)
                   for name in formats}
        for name in args.formats:
            results[name]["greedy_chat"] = answer_agreement(answers["auto"][0], answers[name][0])
            results[name]["greedy_chat"]["texts"] = answers[name][1]
        answered = {"questions": CHAT_QUESTIONS[: args.chat_prompts],
                    "reference": answers["auto"][1]}
    record = {"workload": "kv-accuracy",
              "config": vars(args) | {"model_folder": str(folder), "dtype": dtype_name(dtype),
                                      "device": str(device)},
              "environment": machine_facts(device), "texts": len(texts),
              "tokens": sum(len(ids) for ids in texts), "results": results}
    if args.chat_prompts:
        record["chat"] = answered  # the reference cache's answers; each format's in its result
    publish(record, summary_table(args.model, dtype_name(dtype), args.chat_tokens, results),
            args.output)
    return 0


def summary_table(model: str, dtype: str, chat_tokens: int, results: dict) -> str:
    rows = []
    for name, r in results.items():
        chat = r.get("greedy_chat")
        rows.append([name, r["positions"], 100 * r["top1_agreement"], r["perplexity_reference"],
                     r["perplexity_quantized"], 100 * (r["perplexity_ratio"] - 1),
                     r["mean_kl_nats"],
                     f"{chat['identical']}/{chat['answers']}" if chat else None])
    header = [f"{model} ({dtype})", "positions", "top-1 agreement %", f"ppl, {dtype} KV",
              "ppl, quantized KV", "ppl change %", "mean KL (nats)",
              f"greedy answers identical ({chat_tokens} tokens)"]
    return markdown_table(header, rows)
