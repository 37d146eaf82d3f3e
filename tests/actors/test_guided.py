"""Guided decoding pieces without a model: the constraint in SamplingParams (validated,
msgpack-encodable), the compiler (errors name the field; a cache keyed by constraint), and the
runner's per-request grammar state (masks only constrained rows; kept across preemption,
rebuilt when the output it followed changed). Uses the tiny word-level tokenizer ("w3" ...)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tokenloom.actors.guided import GuidedCompiler, GuidedError
from tokenloom.actors.messages import NewSequence
from tokenloom.actors.model_runner import ModelRunner
from tokenloom.actors.sampling_params import GuidedDecoding, SamplingParams

VOCAB = 256
EOS = 2


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    from tinymodel import save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return GuidedCompiler(AutoTokenizer.from_pretrained(path), VOCAB, (EOS,))


def allowed(mask_row: torch.Tensor) -> list[int]:
    return [t for t in range(VOCAB) if (int(mask_row[t // 32]) >> (t % 32)) & 1]


# -- SamplingParams ------------------------------------------------------------------------
def test_guided_params_round_trip_through_msgpack():
    p = SamplingParams(guided=GuidedDecoding("choice", '["w5","w6"]'), n=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


@pytest.mark.parametrize("kwargs, field", [
    (dict(guided=GuidedDecoding("yaml", "x")), "guided.kind"),
    (dict(guided=GuidedDecoding("regex", "")), "guided.spec"),
    (dict(guided=GuidedDecoding("choice", '["a", ""]')), "guided.spec"),
    (dict(guided=GuidedDecoding("choice", "not json")), "guided.spec"),
    (dict(guided=GuidedDecoding("regex", "a"), ignore_eos=True), "ignore_eos"),
    (dict(guided=GuidedDecoding("regex", "a"), speculative="on"), "speculative"),
])
def test_bad_guided_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field), e.value


# -- compiler ------------------------------------------------------------------------------
@pytest.mark.parametrize("guided, param", [
    (GuidedDecoding("regex", "a[]"), "guided_regex"),
    (GuidedDecoding("regex", r"[^\s\S]"), "guided_regex"),
    (GuidedDecoding("grammar", "root ::= nothing"), "guided_grammar"),
    (GuidedDecoding("json_schema", '{"type": "bogus"}'), "response_format.json_schema"),
])
def test_compile_errors_name_the_field(compiler, guided, param):
    with pytest.raises(GuidedError) as e:
        compiler.compile(guided)
    assert e.value.param == param and str(e.value).startswith(param)
    assert "/project/cpp" not in str(e.value)   # the engine's source location is noise


def test_compiled_grammars_are_cached_by_constraint(compiler):
    a = compiler.compile(GuidedDecoding("regex", "(w1[0-9])+"))
    assert compiler.compile(GuidedDecoding("regex", "(w1[0-9])+")) is a
    assert compiler.compile(GuidedDecoding("regex", "(w2[0-9])+")) is not a


# -- runner state --------------------------------------------------------------------------
def _runner(compiler) -> ModelRunner:
    return ModelRunner(None, None, torch.device("cpu"), (EOS,), guided=compiler)


def _new(outputs, guided=GuidedDecoding("regex", "(w1[0-9]){3}")) -> NewSequence:
    return NewSequence(prompt_token_ids=[5, 6], output_token_ids=list(outputs),
                       sampling_params=SamplingParams(temperature=0, guided=guided))


def test_only_constrained_rows_are_masked(compiler):
    runner = _runner(compiler)
    runner._register("g", _new([10]))
    runner._register("plain", NewSequence(prompt_token_ids=[5], output_token_ids=[],
                                          sampling_params=SamplingParams(temperature=0)))
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    out = runner._apply_guided(logits, ["plain", "g"])
    assert torch.equal(out[0], before[0])                      # untouched, bit for bit
    finite = out[1].isfinite().nonzero()[:, 0].tolist()
    assert finite == list(range(10, 20))                       # the regex's next words only
    assert torch.equal(out[1, 10:20], before[1, 10:20])


def test_preempted_request_resumes_with_its_grammar_state(compiler):
    """1. registered with one output token 2. two more accepted 3. re-registered after a
    preemption with the same output: the very same matcher goes on, and after the third
    word it allows only EOS 4. re-registered with a different (shorter) output: the matcher
    is rebuilt from that output."""
    runner = _runner(compiler)
    runner._register("r", _new([10]))
    state = runner._seqs["r"]
    matcher = state.matcher
    assert matcher.num_accepted == 1 and matcher.accept(11)
    state.output_token_ids.append(11)
    runner._register("r", _new([10, 11]))
    assert runner._seqs["r"].matcher is matcher
    out = runner._apply_guided(torch.zeros(1, VOCAB), ["r"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == list(range(10, 20))
    assert matcher.accept(12)
    state.output_token_ids.append(12)
    runner._register("r", _new([10, 11, 12]))
    out = runner._apply_guided(torch.zeros(1, VOCAB), ["r"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == [EOS]
    runner._register("r", _new([13]))
    rebuilt = runner._seqs["r"].matcher
    assert rebuilt is not matcher and rebuilt.num_accepted == 1


def test_forked_sibling_replays_its_output(compiler):
    """A sequence registered with output already produced (an n>1 sibling) starts from it."""
    runner = _runner(compiler)
    runner._register("s1", _new([14, 15]))
    out = runner._apply_guided(torch.zeros(1, VOCAB), ["s1"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == list(range(10, 20))
    runner._register("s2", _new([14, 15, 16]))
    out = runner._apply_guided(torch.zeros(1, VOCAB), ["s2"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == [EOS]
