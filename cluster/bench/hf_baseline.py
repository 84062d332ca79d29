"""The HuggingFace transformers baseline, run in the same process as tandem's figures.

``generate()`` runs padded static batches: a batch takes as many steps as its longest output,
so its useful tokens per second count only the tokens each request asked for. The best of a
few batch sizes is the baseline. ``generate_batch()`` (continuous batching, where this
transformers version has it) runs the requests with one output length for all.
"""

import time

import torch
from tqdm import tqdm

from cluster.bench.roofline import synchronize
from cluster.bench.workloads import Request


def load_hf_model(folder, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model.to(device).eval()


def padded_batch(requests: list[Request], device: torch.device, pad_id: int = 0):
    """Left-padded (B, L) input ids and attention mask."""
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(requests):
        ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def timed_generate(model, requests: list[Request], new_tokens: int,
                   device: torch.device) -> float:
    ids, mask = padded_batch(requests, device)
    synchronize(device)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    synchronize(device)
    return time.perf_counter() - start


def generate_throughput(model, requests: list[Request], batch_sizes: list[int],
                        max_new_tokens: int, device: torch.device) -> dict:
    """Useful output tok/s of one padded generate() over the first B requests, per B.
    max_new_tokens caps each request's output (less work than asked); 0: no cap."""
    timed_generate(model, requests[:2], 4, device)  # warm-up
    runs = []
    for batch_size in tqdm(batch_sizes, desc="hf generate()"):
        batch = requests[:batch_size]
        longest = max(r.max_tokens for r in batch)
        new_tokens = min(longest, max_new_tokens) if max_new_tokens else longest
        seconds = timed_generate(model, batch, new_tokens, device)
        useful = sum(min(r.max_tokens, new_tokens) for r in batch)
        capped = new_tokens < longest  # less work than tandem's
        runs.append({"batch_size": len(batch), "new_tokens": new_tokens, "capped": capped,
                     "seconds": seconds, "useful_output_tokens": useful,
                     "output_tokens_per_s": useful / seconds})
    best = max(runs, key=lambda run: run["output_tokens_per_s"])
    return {"runs": runs, "best": best}


def generate_label(run: dict) -> str:
    """The table's name for a generate() run: whether it did the requests' own work."""
    work = f"<= {run['new_tokens']} new" if run["capped"] else "their own output lengths"
    return f"HF generate() batch {run['batch_size']} (first {run['batch_size']} requests, {work})"


def generate_latency(model, prompt: list[int], output_len: int, device: torch.device) -> dict:
    """Batch 1: TTFT from a 1-token generate, TPOT from the difference with a long one."""
    request = [Request(prompt, output_len)]
    timed_generate(model, request, 4, device)  # warm-up
    ttft = sorted(timed_generate(model, request, 1, device) for _ in range(3))[1]
    total = timed_generate(model, request, output_len, device)
    tpot = (total - ttft) / max(output_len - 1, 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "tokens_per_s": 1 / tpot,
            "output_len": output_len}


def generate_batch_throughput(model, requests: list[Request], max_new_tokens: int,
                              device: torch.device) -> dict:
    """Continuous batching through ``generate_batch()``; an 'error' entry where it fails. Every
    request gets max_new_tokens (0: the longest request's), all of them counted."""
    if not hasattr(model, "generate_batch"):
        return {"error": "this transformers version has no generate_batch()"}
    from transformers import GenerationConfig

    max_new_tokens = max_new_tokens or max(r.max_tokens for r in requests)
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=-1, pad_token_id=0)
    inputs = [r.prompt_token_ids for r in requests]
    try:
        synchronize(device)
        start = time.perf_counter()
        results = model.generate_batch(inputs=inputs, generation_config=config,
                                       progress_bar=True)
        synchronize(device)
        seconds = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 — an optional baseline must not end the run
        return {"error": f"{type(error).__name__}: {error}"[:500]}
    tokens = sum(len(out.generated_tokens) for out in results.values())
    return {"num_requests": len(requests), "new_tokens": max_new_tokens, "seconds": seconds,
            "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}
