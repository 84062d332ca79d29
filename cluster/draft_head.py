"""`tandem draft-head train`: an EAGLE-3 head for a model that has none, from its own answers.

1. Questions: a built-in set (cluster/draft_head_prompts.py) and, Magpie-style, questions the
   model writes itself (given only its chat template's opening of a user turn).
2. Answers: tandem answers every question (greedy), so the head learns the distribution it
   will draft for (the anchors' advice: regenerate the data with the target).
3. Features: a teacher-forced pass of the target (transformers) over question + answer gives
   the residual streams the head reads and the target's distribution at every position, made
   again for each training step rather than kept (at 5,000 answers they would be ~60 GB).
4. Training: workers/speculative/eagle/training.py (the training-time test), AdamW.
5. The head is written in the EAGLE-3 layout that ``{"method": "eagle3", "model": FOLDER}``
   loads, and its mean accepted length is measured on questions it was not trained on.
"""

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.draft_head_prompts import QUESTIONS
from router.sampling_params import SamplingParams

SENTINEL = "\u2063"  # a character no question holds: where the user turn's text goes


@dataclass
class Example:
    tokens: torch.Tensor  # (T,) question and answer
    answer_start: int  # the first answer token's index


def release_device_memory() -> None:
    """What an engine or the teacher held on the GPU, back before the next one starts."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def magpie_questions(llm, count: int, seed: int, max_tokens: int = 48) -> list[str]:  # type: ignore[no-untyped-def]
    """Questions the model writes itself, from its template's opening of a user turn."""
    if count == 0:
        return []
    tokenizer = llm.engine.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}],
                                         tokenize=False)
    opening = tokenizer.encode(text[:text.index(SENTINEL)], add_special_tokens=False)
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed + i)
              for i in range(count)]
    outputs = llm.generate([opening] * count, params)
    questions = [out.outputs[0].text.strip() for out in outputs]
    return [q for q in questions if q]


def answer(llm, questions: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    """(question tokens, answer tokens) of each question, answered greedily."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    return [(out.prompt_token_ids, list(out.outputs[0].token_ids)) for out in outputs]


@dataclass
class Pack:
    """Several examples trained in one step: their tokens end to end, ``segments`` saying
    whose each token is, ``answer`` which tokens are answers'."""
    examples: list[Example]
    tokens: torch.Tensor
    segments: torch.Tensor
    answer: torch.Tensor


def packs(examples: list[Example], order: list[int], pack_tokens: int) -> list[Pack]:
    """The examples in ``order``, consecutive ones packed while they fit in ``pack_tokens``
    (an example longer than that is a pack alone)."""
    groups: list[list[Example]] = []
    size = 0
    for index in order:
        example = examples[index]
        if groups and size + len(example.tokens) <= pack_tokens:
            groups[-1].append(example)
            size += len(example.tokens)
        else:
            groups.append([example])
            size = len(example.tokens)
    out = []
    for group in groups:
        out.append(Pack(group, torch.cat([e.tokens for e in group]),
                        torch.cat([torch.full((len(e.tokens),), i) for i, e in enumerate(group)]),
                        torch.cat([torch.arange(len(e.tokens)) >= e.answer_start
                                   for e in group])))
    return out


@torch.no_grad()  # not inference_mode: its tensors feed the head's backward
def teacher_forced(hf, sequences: list[torch.Tensor], aux_layers: tuple[int, ...],  # type: ignore[no-untyped-def]
                   draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The streams the head reads (T, 3 H) and the target's next-token distribution over the
    draft vocabulary (T, draft vocabulary) at every position of ``sequences`` end to end
    (T tokens in all), from one call over them right-padded."""
    lengths = [len(tokens) for tokens in sequences]
    device = sequences[0].device
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.int64, device=device)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(sequences):
        ids[row, :len(tokens)] = tokens
        mask[row, :len(tokens)] = 1
    out = hf(ids, attention_mask=mask, output_hidden_states=True)
    streams = out.hidden_states  # [i]: entering layer i
    features = torch.cat([torch.cat([streams[i][row, :length] for i in aux_layers], dim=-1)
                          for row, length in enumerate(lengths)]).float()
    logits = torch.cat([out.logits[row, :length, draft_ids]
                        for row, length in enumerate(lengths)])
    return features, logits.float().softmax(-1)


FEATURE_NOISE = 0.05  # the training noise's share of the features' spread (with_noise)
# tokens a training step, about one answer: at 2,048 the default command made ~130 optimizer
# steps instead of ~1,300 and its head accepted 1.24 tokens a verify against 1.36 (CPU, k 3)
PACK_TOKENS = 256


def with_noise(features: torch.Tensor, scale: float) -> torch.Tensor:
    """The features with Gaussian noise of ``scale`` times their overall spread. A small
    model's residual stream has a few dimensions of massive activations (SmolLM2-135M: |x| up
    to ~25,000 in the streams of layers 15 and 27, where a typical dimension spreads ~10 and
    layer 2's ~1.6), so this is large noise on every ordinary dimension: it regularizes a head
    trained on few tokens. Noise in each dimension's own spread instead gave a worse head
    (docs/experiments.md)."""
    if scale <= 0:
        return features
    return features + scale * features.std() * torch.randn_like(features)


def one_cycle(progress: float, max_lr: float, warm_up: float = 0.1) -> float:
    """The learning rate at ``progress`` (0..1) of a run: a cosine rise from max_lr / 25 to
    max_lr over the first ``warm_up``, then a cosine fall to max_lr / 25e4 (torch's OneCycleLR,
    as a function of progress so that a time limit can end the run on its schedule)."""
    def cosine(start: float, end: float, share: float) -> float:
        return end + (start - end) / 2 * (1 + math.cos(math.pi * min(max(share, 0.0), 1.0)))

    low = max_lr / 25
    if progress < warm_up:
        return cosine(low, max_lr, progress / warm_up)
    return cosine(max_lr, low / 1e4, (progress - warm_up) / (1 - warm_up))


def train_head(examples: list[Example], hf, head, epochs: int, steps: int, lr: float,  # type: ignore[no-untyped-def]
               device: torch.device, seed: int, pack_tokens: int = PACK_TOKENS,
               noise: float = FEATURE_NOISE, time_limit: float | None = None) -> list[float]:
    """Epochs of AdamW over the examples (shuffled, packed up to ``pack_tokens`` a step, the
    target's features made for each pack and given a little noise); each epoch's mean loss
    (of the epochs begun). ``time_limit`` (seconds): the run's progress is the larger of its
    share of steps and of that time, so the schedule ends, and training stops, at whichever
    comes first (a device call has a time limit)."""
    from workers.speculative.eagle.training import ttt_loss

    rng = random.Random(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    orders = []
    for _ in range(epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        orders.append(packs(examples, order, pack_tokens))
    total = max(1, sum(len(o) for o in orders))
    started = time.monotonic()

    def progress(step: int) -> float:
        by_time = (time.monotonic() - started) / time_limit if time_limit else 0.0
        return max(step / total, by_time)

    aux, draft_ids = head.shape.aux_layer_ids, head.draft_ids
    means: list[float] = []
    step = 0
    for epoch in orders:
        losses = []
        for pack in epoch:
            done = progress(step)
            if done >= 1:
                return means + ([sum(losses) / len(losses)] if losses else [])
            for group in optimizer.param_groups:
                group["lr"] = one_cycle(done, lr)
            features, target_probs = teacher_forced(
                hf, [e.tokens.to(device) for e in pack.examples], aux, draft_ids)
            features = with_noise(features, noise)
            tokens, segments = pack.tokens.to(device), pack.segments.to(device)
            loss = ttt_loss(head(tokens, features, steps, segments), target_probs,
                            pack.answer.to(device), segments)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            step += 1
            losses.append(loss.item())
        if losses:
            means.append(sum(losses) / len(losses))
    return means


def accepted_length(model: str, head: Path, questions: list[str], k: int, max_tokens: int,
                    **engine_args: object) -> tuple[float, list[float]]:
    """Mean tokens a verify step makes (the bonus token included) at fixed k, and each
    draft position's acceptance, answering ``questions`` greedily with the head."""
    from cluster.engine.llm import LLM

    llm = LLM(model, speculative_config={"method": "eagle3", "model": str(head),
                                         "num_speculative_tokens": k, "adaptive": False},
              **engine_args)
    try:
        llm.chat([[{"role": "user", "content": q}] for q in questions],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens))
        stats = llm.stats()
        per_position = list(llm.engine.metrics.spec_decode_accepted_per_position)
    finally:
        llm.engine.shutdown()
    verifies = max(stats.spec_decode_num_drafts, 1)
    mean = (stats.spec_decode_num_accepted_tokens + verifies) / verifies
    return mean, [count / verifies for count in per_position[:k]]


def train_draft_head(model: str, output: Path, *, questions: int, self_written: int,
                     max_tokens: int, epochs: int, steps: int, lr: float, draft_vocab: int,
                     held_out: int, k: int, device: str, seed: int,
                     pack_tokens: int = PACK_TOKENS, noise: float = FEATURE_NOISE,
                     init: Path | None = None, time_limit: float | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    from cluster.engine.llm import LLM
    from workers.speculative.eagle.training import (
        HeadShape,
        TrainableHead,
        draft_vocabulary,
        load_trainable_head,
        save_head,
    )

    started = time.perf_counter()
    if questions + held_out > len(QUESTIONS):
        raise ValueError(f"--questions {questions} and --held-out {held_out}: the built-in set "
                         f"has {len(QUESTIONS)}")
    train_questions, eval_questions = QUESTIONS[:questions], QUESTIONS[-held_out:] \
        if held_out else []
    engine_args = {"device": device, "dtype": "float32" if device == "cpu" else "auto"}
    llm = LLM(model, **engine_args)  # type: ignore[arg-type]
    try:
        written = magpie_questions(llm, self_written, seed)
        pairs = answer(llm, train_questions + written, max_tokens)
        folder = llm.engine.model_path
    finally:
        llm.engine.shutdown()
        del llm
        release_device_memory()
    torch_device = torch.device("cuda" if device != "cpu" and torch.cuda.is_available()
                                else "cpu")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(torch_device)
    examples = [Example(torch.tensor(question + reply), len(question))
                for question, reply in pairs]
    torch.manual_seed(seed)
    embedding, lm_head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    if init is not None:  # go on training a head written before
        head = load_trainable_head(init, hf.config, embedding, lm_head).to(torch_device)
    else:
        shape = HeadShape.for_target(hf.config, draft_vocab)
        draft_ids = draft_vocabulary([reply for _, reply in pairs], shape.draft_vocab_size)
        head = TrainableHead(shape, embedding, draft_ids, lm_head).to(torch_device)
    draft_ids = head.draft_ids
    hf.requires_grad_(False)
    training = time.perf_counter()
    losses = train_head(examples, hf, head, epochs, steps, lr, torch_device, seed, pack_tokens,
                        noise, time_limit)
    training = time.perf_counter() - training
    del hf
    release_device_memory()
    save_head(head, output)
    report = {"head": str(output), "questions": len(train_questions),
              "self_written": len(written), "train_tokens": sum(len(r) for _, r in pairs),
              "draft_vocab": len(draft_ids), "epoch_losses": losses,
              "train_seconds": round(training, 1)}
    if eval_questions:
        mean, per_position = accepted_length(model, output, eval_questions, k, max_tokens,
                                             **engine_args)
        report |= {"k": k, "mean_accepted_length": mean, "accepted_per_position": per_position}
    report["seconds"] = time.perf_counter() - started
    return report
