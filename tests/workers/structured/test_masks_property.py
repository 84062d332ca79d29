"""Random logits through the grammar mask and the real sampler: every sampled token is one
the grammar allows, and every output that ends is valid (parsed, validated, matched).

No model: the logits are noise, so the runs take paths a polite model never would."""

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from cluster.bench.structured_corpus import OTHERS, SCHEMAS
from router.structured_outputs import StructuredOutputs
from workers.catalog import DEFAULT_MODEL, model_path
from workers.request_state import RequestState
from workers.sampler import Sampler, SamplingSpec
from workers.structured.backend import GrammarCompiler
from workers.structured.masks import LogitConstraints
from workers.structured.row_grammar import RowGrammar

pytestmark = pytest.mark.slow
VOCAB, EOS = 49152, 2
MAX_TOKENS = 160
SPECS = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=1.0, seed=7),
         SamplingSpec(temperature=0.7, top_p=0.9, min_p=0.02, seed=11)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(model_path(DEFAULT_MODEL)), local_files_only=True)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS], model_path(DEFAULT_MODEL))


def run(compiled, spec: SamplingSpec, seed: int) -> tuple[list[int], bool]:
    """Samples from noise through the mask until EOS or MAX_TOKENS; (tokens, ended)."""
    noise = torch.Generator().manual_seed(seed)
    grammar = RowGrammar(compiled.compiled, compiled.and_row)
    state = RequestState([0], 1, [], spec, None, "row", grammar)
    if spec.seed is not None:
        state.generator = torch.Generator().manual_seed(spec.seed)
    constraints, sampler = LogitConstraints(VOCAB, torch.device("cpu")), Sampler(noise)
    for _ in range(MAX_TOKENS):
        logits = torch.randn(1, VOCAB, generator=noise) * 4
        masked, _ = constraints.apply(logits, [state])
        out = sampler(masked, [spec], [[0]], [state.output_token_ids],
                      [state.generator_for_next_token()])
        token = int(out.token_ids[0])
        state.token_ids.append(token)
        if token == EOS:
            return state.output_token_ids[:-1], True
    return state.output_token_ids, False


def accepted(compiled, tokens: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(compiled.compiled)
    return all(matcher.accept_token(t) for t in tokens)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_every_ended_output_is_valid_json_for_its_schema(tokenizer, compiler, schema):
    compiled = compiler.compile(StructuredOutputs(json=schema))
    ended = 0
    for index, spec in enumerate(SPECS):
        for seed in range(3):
            tokens, done = run(compiled, spec, seed * 10 + index)
            assert accepted(compiled, tokens)
            if done:
                ended += 1
                jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
    assert ended >= 6, f"only {ended} of 9 runs ended: the corpus must let noise finish"


@pytest.mark.parametrize("structured", OTHERS, ids=[s.kind for s in OTHERS])
def test_regex_choice_grammar_and_json_object_outputs_match(tokenizer, compiler, structured):
    compiled = compiler.compile(structured)
    for index, spec in enumerate(SPECS):
        for seed in range(3):
            tokens, done = run(compiled, spec, seed * 10 + index)
            assert accepted(compiled, tokens)
            if not done:
                assert structured.kind == "json_object"  # noise may nest objects past the cap
                continue
            text = tokenizer.decode(tokens)
            if structured.kind == "regex":
                assert re.fullmatch(structured.regex, text), text
            elif structured.kind == "choice":
                assert text in structured.choice
            elif structured.kind == "grammar":
                assert re.fullmatch(r"\([a-c]{1,4}\)|none", text), text
            else:
                assert isinstance(json.loads(text), dict)


def test_draft_masks_follow_the_drafts_and_stop_at_the_first_refused(tokenizer, compiler):
    compiled = compiler.compile(StructuredOutputs(choice=("yes", "no")))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    state = RequestState([0], 1, [], SamplingSpec(temperature=0.0), None, "r",
                         RowGrammar(compiled.compiled, compiled.and_row))
    constraints = LogitConstraints(VOCAB, torch.device("cpu"))
    drafts = [yes + [EOS, 5], [tokenizer.encode("maybe", add_special_tokens=False)[0]]]
    width = max(len(d) for d in drafts) + 1
    logits = torch.zeros(2 * width, VOCAB)
    masked, valid = constraints.apply(logits, [state, state], drafts, width)
    assert valid == [len(yes) + 1, 0]  # "yes" then EOS; nothing may follow EOS or be "maybe"
    allowed = (masked > float("-inf"))
    assert allowed[0, yes[0]] and not allowed[0, EOS]
    assert allowed[len(yes), EOS].item() and allowed[len(yes)].sum() == 1  # only the stop
    assert allowed[len(yes) + 2].all()  # past the first refused draft: never sampled from
    assert state.grammar.num_accepted == 0 and accepted(compiled, yes + [EOS])  # rolled back


def test_a_refused_token_in_the_output_fails_the_row_and_allows_only_the_stop(compiler):
    compiled = compiler.compile(StructuredOutputs(choice=("yes", "no")))
    state = RequestState([0, 17], 1, [], SamplingSpec(temperature=0.0), None, "r",
                         RowGrammar(compiled.compiled, compiled.and_row))
    constraints = LogitConstraints(VOCAB, torch.device("cpu"))
    masked, _ = constraints.apply(torch.zeros(1, VOCAB), [state])
    assert state.grammar.failed == ("token 17 at output position 0 is not allowed by the "
                                    "request's grammar")
    assert (masked[0] > float("-inf")).nonzero().flatten().tolist() == [EOS]
    assert constraints.take_failures() == [("r", state.grammar.failed)]
    constraints.apply(torch.zeros(1, VOCAB), [state])
    assert constraints.take_failures() == []  # reported once


def test_logit_bias_is_added_before_the_mask_on_every_row_that_asks():
    spec = SamplingSpec(temperature=0.0, logit_bias=((3, 100.0), (5, -100.0)))
    biased = RequestState([0], 1, [], spec, None, "a")
    plain = RequestState([0], 1, [], SamplingSpec(temperature=0.0), None, "b")
    constraints = LogitConstraints(10, torch.device("cpu"))
    logits = torch.arange(20, dtype=torch.float32).view(2, 10)
    out, _ = constraints.apply(logits, [biased, plain])
    assert out[0, 3].item() == 103.0 and out[0, 5].item() == -95.0
    assert torch.equal(out[1], logits[1]) and logits[0, 3].item() == 3.0  # input untouched


def test_rows_filled_together_get_the_masks_each_gets_alone(tokenizer, compiler):
    """A batch's grammar rows: every row's mask equals the one it gets alone, whatever its
    grammar and state (a failed row, a plain row and padding among them)."""
    kinds = [StructuredOutputs(json=SCHEMAS[0]), *OTHERS, StructuredOutputs(choice=("yes", "no"))]
    compiled = [compiler.compile(kind) for kind in kinds]
    outputs = [tokens for tokens, _ in (run(c, SPECS[1], 3) for c in compiled)]

    def states():
        rows = [RequestState([0, *out[: len(out) // 2]], 1, [], SPECS[0], None, f"r{i}",
                             RowGrammar(c.compiled, c.and_row))
                for i, (c, out) in enumerate(zip(compiled, outputs, strict=True))]
        rows[-1].token_ids.append(17)  # refused by ("yes", "no"): the row fails
        return [*rows, RequestState([0], 1, [], SPECS[0], None, "plain"), None]

    logits = torch.randn(len(kinds) + 2, VOCAB, generator=torch.Generator().manual_seed(0))
    together, _ = LogitConstraints(VOCAB, torch.device("cpu")).apply(logits, states())
    for row, state in enumerate(states()):
        alone, _ = LogitConstraints(VOCAB, torch.device("cpu")).apply(logits[row:row + 1],
                                                                      [state])
        assert torch.equal(together[row], alone[0]), f"row {row}"
    allowed = (together > float("-inf")).sum(dim=1).tolist()
    assert allowed[-3] == 1 and allowed[-2:] == [VOCAB, VOCAB]  # failed: the stop alone
    assert all(0 < count < VOCAB for count in allowed[:-3])
