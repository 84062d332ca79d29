"""Training an EAGLE-3 head: the training-time test sees what drafting sees (its step j at i
equals the saved head's chain anchored at i, run by the engine's head over the paged cache),
the draft vocabulary, and a head that learns."""

import pytest
import torch
from transformers import LlamaConfig

from tests.workers.speculative.test_eagle_head import Row
from workers.attention.reference import ReferenceAttentionBackend
from workers.input_batch import (
    DecodeRows,
    block_table_array,
    build_input_batch,
    decode_batch,
    slots_of,
)
from workers.kv_cache import allocate_kv_caches
from workers.speculative.eagle.head import EagleHead
from workers.speculative.eagle.head_config import read_head_config
from workers.speculative.eagle.head_weights import head_tensors
from workers.speculative.eagle.training import (
    HeadShape,
    TrainableHead,
    draft_vocabulary,
    load_trainable_head,
    save_head,
    ttt_loss,
)
from workers.step_input import ScheduledRequest

TARGET = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                     max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6)
CPU = torch.device("cpu")


def random_head(seed: int = 0) -> TrainableHead:
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(50, 64, generator=generator)
    lm_head = torch.randn(50, 64, generator=generator)
    shape = HeadShape.for_target(TARGET, draft_vocab_size=20)
    torch.manual_seed(seed)
    head = TrainableHead(shape, embedding, draft_vocabulary([list(range(0, 50, 2))], 20),
                         lm_head)
    for param in (head.input_layernorm, head.hidden_norm, head.post_attention_layernorm,
                  head.norm):
        param.data += 0.2 * torch.randn(64, generator=generator)
    return head


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens_sorted():
    answers = [[5, 5, 9, 1], [9, 9, 2, 5], [7]]
    # 5 and 9 three times each, then 1, 2 and 7 once: the lowest ids among the ties
    assert draft_vocabulary(answers, 4).tolist() == [1, 2, 5, 9]


def test_each_ttt_step_is_the_saved_heads_chain_anchored_at_each_position(tmp_path):
    head = random_head()
    tokens = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(3))
    features = torch.randn(12, 3 * 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ttt = head(tokens, features, steps=3)
    save_head(head, tmp_path / "head", dtype=torch.float32)
    config = read_head_config(tmp_path / "head", TARGET)
    assert config.aux_layer_ids == (2, 3, 3) and config.draft_vocab_size == 20
    served = EagleHead(config, ReferenceAttentionBackend())
    served.load_weights(head_tensors(tmp_path / "head"))
    served.share_target(head.embedding, None)
    served.build_rotary_table(128)
    blocks = [4, 1, 7, 2]
    table = block_table_array([blocks])
    for anchor in (0, 5, 8):
        caches = allocate_kv_caches(config.hf_config(), 1, 8, 4, torch.float32, CPU)
        shifted = Row(tokens[1:].tolist(), blocks)  # position p takes token p + 1
        batch = build_input_batch([ScheduledRequest("a", 0, anchor + 1)], {"a": shifted}, 4,
                                  CPU)
        rows, stream = served(batch.input_ids, batch.positions, features[:anchor + 1], caches,
                              batch.meta)
        logits = [served.lm_head(rows[-1:])]
        hidden = stream[-1:]
        for step in (1, 2):  # teacher-forced: the true token, the head's own hidden
            at = torch.tensor([anchor + step]).numpy()
            chain = DecodeRows(["a"], tokens[anchor + step + 1:anchor + step + 2].numpy(), at,
                               slots_of(table, torch.zeros(1, dtype=torch.int64).numpy(), at,
                                        4), table)
            step_batch = decode_batch(chain, CPU)
            rows, hidden = served(step_batch.input_ids, step_batch.positions, hidden, caches,
                                  step_batch.meta)
            logits.append(served.lm_head(rows))
        for step in range(3):
            torch.testing.assert_close(logits[step][0], ttt[step][anchor], rtol=1e-4,
                                       atol=1e-4)


def test_a_head_trained_on_a_sequence_predicts_its_target_better():
    head = random_head(1)
    tokens = torch.randint(0, 50, (24,), generator=torch.Generator().manual_seed(5))
    features = torch.randn(24, 3 * 64, generator=torch.Generator().manual_seed(6))
    # the target's distribution: the next token, as a one-hot over the draft vocabulary
    position = torch.searchsorted(head.draft_ids, tokens.roll(-1)).clamp(max=19)
    target_probs = torch.nn.functional.one_hot(position, 20).float()
    answer = torch.arange(24) >= 6
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        loss = ttt_loss(head(tokens, features, steps=3), target_probs, answer)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_packed_sequences_train_as_each_alone():
    """Two sequences packed end to end give each one's own TTT logits and loss terms."""
    head = random_head(2)
    generator = torch.Generator().manual_seed(7)
    first, second = torch.randint(0, 50, (9,), generator=generator), \
        torch.randint(0, 50, (7,), generator=generator)
    features = torch.randn(16, 3 * 64, generator=generator)
    segments = torch.tensor([0] * 9 + [1] * 7)
    with torch.no_grad():
        packed = head(torch.cat([first, second]), features, steps=3, segments=segments)
        alone = [head(first, features[:9], steps=3), head(second, features[9:], steps=3)]
    for step in range(3):  # the rows predicting within their sequence (n - 1 - step of n)
        torch.testing.assert_close(packed[step][:8 - 1 - step], alone[0][step][:8 - 1 - step],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[step][9:15 - 1 - step],
                                   alone[1][step][:6 - 1 - step], rtol=1e-5, atol=1e-5)
    # the loss counts no prediction across the seam: equal to a loss over the two alone with
    # each step's valid positions pooled
    probs = torch.softmax(torch.randn(16, 20, generator=generator), -1)
    answer = torch.ones(16, dtype=torch.bool)
    loss = ttt_loss(packed, probs, answer, segments)
    expected = torch.zeros(())
    for step in range(3):
        terms = []
        for logits, part in ((alone[0][step], probs[:9]), (alone[1][step], probs[9:])):
            n = part.shape[0] - 1
            valid = torch.arange(n) + step + 2 <= n
            terms.append(-(part[(torch.arange(n) + step + 1).clamp(max=n)]
                           * logits.log_softmax(-1)).sum(-1)[valid])
        expected = expected + 0.8 ** step * torch.cat(terms).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_a_written_head_is_read_back_to_train_on(tmp_path):
    """--init: the head as written (float32 here), its draft vocabulary and streams kept;
    one written for another target's shape is refused with what differs."""
    head = random_head(3)
    save_head(head, tmp_path / "head", dtype=torch.float32)
    target_lm_head = torch.zeros(50, 64)  # overwritten by the written head's
    again = load_trainable_head(tmp_path / "head", TARGET, head.embedding, target_lm_head)
    assert torch.equal(again.draft_ids, head.draft_ids)
    assert again.shape == head.shape
    tokens = torch.randint(0, 50, (10,), generator=torch.Generator().manual_seed(8))
    features = torch.randn(10, 3 * 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        for ours, theirs in zip(again(tokens, features, 3), head(tokens, features, 3),
                                strict=True):
            assert torch.equal(ours, theirs)
    wider = LlamaConfig(**{**TARGET.to_dict(), "intermediate_size": 128})
    with pytest.raises(ValueError, match=r"midlayer.mlp.gate_proj.weight is \(96, 64\), the "
                                         r"target gives \(128, 64\)"):
        load_trainable_head(tmp_path / "head", wider, head.embedding, target_lm_head)
