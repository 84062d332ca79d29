"""Drafts left on the device: the table a chain's steps make, the verify step's input built
from it, the benchmark's given drafts, and a speculative step that never reads its drafts."""

import numpy as np
import pytest
import torch

from cluster import LLM, SamplingParams
from tests.eagle_heads import write_head
from workers.speculative.device_drafts import DeviceDrafts, drafts_table


def test_the_table_holds_each_row_s_drafts_in_the_step_s_order():
    # three rows drafting 1, 3 and 2: the chain ran them longest first (order 1, 2, 0)
    proposed = [torch.tensor([11, 21, 31]), torch.tensor([12, 22]), torch.tensor([13])]
    table = drafts_table(proposed, order=[1, 2, 0], counts=[1, 3, 2])
    assert table.to_host() == [[31], [11, 12, 13], [21, 22]]


def test_a_chain_in_the_step_s_order_stacks_its_steps_as_they_are():
    # every row drafted every step, the longest first already: no gather, the same table
    proposed = [torch.tensor([11, 21]), torch.tensor([12, 22])]
    table = drafts_table(proposed, order=[0, 1], counts=[2, 2])
    assert table.to_host() == [[11, 12], [21, 22]]
    # rows that stop early keep zeros past their drafts
    short = drafts_table([torch.tensor([11, 21]), torch.tensor([12])], order=[0, 1],
                         counts=[2, 1])
    assert short.table.tolist() == [[11, 12], [21, 0]] and short.to_host() == [[11, 12], [21]]


def test_the_verify_input_takes_the_drafts_after_each_row_s_token():
    table = DeviceDrafts(torch.tensor([[7, 8, 9], [5, 0, 0]]), [3, 1])
    # rows: sequence a's token then 3 drafts, b's token alone, c's token then 1 draft
    tokens = np.array([100, 0, 0, 0, 200, 300, 0])
    assert table.verify_input(tokens, starts=[0, 5]).tolist() == [100, 7, 8, 9, 200, 300, 5]


def test_rows_of_k_drafts_each_take_them_in_one_copy():
    """Every row k drafts and none without: the table goes in whole (the general path's
    answer; a row without drafts takes the general path)."""
    table = DeviceDrafts(torch.tensor([[7, 8], [5, 6]]), [2, 2])
    tokens = np.array([100, 0, 0, 200, 0, 0])
    assert table.verify_input(tokens, starts=[0, 3]).tolist() == [100, 7, 8, 200, 5, 6]
    with_plain = np.array([100, 0, 0, 300, 200, 0, 0])
    assert table.verify_input(with_plain, starts=[0, 4]).tolist() == [100, 7, 8, 300, 200, 5,
                                                                      6]


def test_drafts_given_with_the_step_win_and_the_draft_s_own_stay():
    table = DeviceDrafts(torch.tensor([[7, 8], [5, 6]]), [2, 2])
    given = table.given([None, [1, 2]])
    assert given.to_host() == [[7, 8], [1, 2]] and table.to_host() == [[7, 8], [5, 6]]
    assert table.given([None, None]) is table


def test_a_verify_step_never_reads_its_drafts(tiny_models, tmp_path, monkeypatch):
    """Greedy output as transformers' with an EAGLE head and with the target as its own draft
    model: the head's drafts never come to the host (every verify step is all decodes), and
    the draft model reads each of its tables once, after the verify (it settles its own K/V
    against the kept tokens at its next drafting)."""
    reads = []
    to_host = DeviceDrafts.to_host

    def counted(self):  # type: ignore[no-untyped-def]
        if self._host is None:
            reads.append(len(self.counts))
        return to_host(self)

    monkeypatch.setattr(DeviceDrafts, "to_host", counted)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    model = str(tiny_models["llama"])
    plain = LLM(model, device="cpu", dtype="float32", block_size=4)
    expected = [out.token_ids for out in plain.generate(prompts, greedy)]
    write_head(tmp_path / "head", "eagle3", vocab=1001,
               config_extra={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})
    for draft, tables_read in ((str(tmp_path / "head"), False), (model, True)):
        reads.clear()
        llm = LLM(model, device="cpu", dtype="float32", block_size=4,
                  speculative_config={"model": draft, "num_speculative_tokens": 3,
                                      "adaptive": False})
        assert [out.token_ids for out in llm.generate(prompts, greedy)] == expected
        stats = llm.stats()
        assert stats.spec_decode_num_drafts > 0
        if tables_read:  # the target as its draft: every draft kept
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
            assert 0 < sum(reads) <= stats.spec_decode_num_drafts
        else:
            assert reads == []


@pytest.mark.parametrize("count", [1, 2])
def test_a_table_is_read_once(count):
    table = DeviceDrafts(torch.arange(6).view(2, 3), [3, count])
    first = table.to_host()
    assert table.to_host() is first and first == [[0, 1, 2], [3, 4, 5][:count]]
