"""Grammars compile off the engine loop; a spec compiled before joins at once, without a trip
through the pool, its checks and its serialized form made once per spec."""

import pickle

import pytest

import workers.structured.backend as backend
from cluster.engine.grammars import GrammarCompiles
from cluster.engine.tokenizer import eos_token_ids, load_tokenizer
from router.structured_outputs import StructuredOutputs

SPEC = StructuredOutputs(regex=r"[0-9]{3}")


@pytest.fixture
def compiles(tiny_chat_model):
    tokenizer = load_tokenizer(tiny_chat_model)
    compiles = GrammarCompiles(tokenizer, tiny_chat_model, 49152,
                               eos_token_ids(tiny_chat_model, tokenizer))
    yield compiles
    compiles.shutdown()


def test_a_spec_compiled_before_is_ready_when_it_is_added(compiles):
    compiles.add("a", SPEC, [])
    compiles.wait(60.0)
    ((first, ref, error),) = compiles.ready()
    assert first.request_id == "a" and error is None
    compiles.add("b", SPEC, [])
    assert compiles.waiting[0].grammar.done()  # no pool: it joins in the step it arrives
    ((second, again, _),) = compiles.ready()
    assert second.request_id == "b" and again is ref
    compiles.add("c", StructuredOutputs(regex=r"[a-z]{2}"), [])  # another spec: compiled
    compiles.wait(60.0)
    assert compiles.ready()[0][1] is not ref


def test_a_grammar_is_serialized_once_for_every_request_of_its_spec(compiles):
    compiles.add("a", SPEC, [])
    compiles.wait(60.0)
    ((_, ref, _),) = compiles.ready()
    first = pickle.dumps(ref)
    ref.compiled = None  # a second pickling must not need the compiled grammar again
    assert pickle.dumps(ref) == first
    rebuilt = pickle.loads(first)
    assert rebuilt.key == SPEC.key and rebuilt.compiled is not None


def test_a_spec_checked_before_is_not_built_again(monkeypatch):
    spec = StructuredOutputs(regex=r"[0-9]{5}-x")
    backend.check_convertible(spec)
    monkeypatch.setattr(backend, "to_grammar", lambda structured: 1 / 0)
    backend.check_convertible(spec)  # from the checked keys: to_grammar is not called
    other = StructuredOutputs(regex=r"[0-9]{6}-y")
    with pytest.raises(ValueError, match="^structured_outputs.regex does not compile: "
                                         "division by zero$"):
        backend.check_convertible(other)  # an unchecked spec is built
