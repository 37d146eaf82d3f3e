"""SamplingParams: validation names the field, values are normalised, msgspec round-trips."""

import math

import msgspec
import pytest

from tokenloom.actors.sampling_params import SamplingParams

NAN = float("nan")
INF = float("inf")

INVALID = [
    # (field, value, fragment of the allowed range the message must state)
    ("n", 0, "in [1, 128]"),
    ("n", 129, "in [1, 128]"),
    ("n", 2.0, "int"),
    ("n", True, "int"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", True, "int"),
    ("max_tokens", 3.5, "int"),
    ("max_tokens", "16", "int"),
    ("min_tokens", -1, ">= 0"),
    ("min_tokens", False, "int"),
    ("temperature", -1.0, ">= 0"),
    ("temperature", NAN, ">= 0"),
    ("temperature", INF, ">= 0"),
    ("temperature", True, ">= 0"),
    ("temperature", "1", ">= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.01, "in (0, 1]"),
    ("top_p", NAN, "in (0, 1]"),
    ("top_k", -2, ">= -1"),
    ("top_k", 1.5, ">= -1"),
    ("top_k", True, ">= -1"),
    ("min_p", -0.1, "in [0, 1]"),
    ("min_p", 1.5, "in [0, 1]"),
    ("min_p", NAN, "in [0, 1]"),
    ("seed", 1.0, "int"),
    ("seed", True, "int"),
    ("seed", 2**64, f"in [{-(2**63)}, {2**64 - 1}]"),
    ("seed", -(2**63) - 1, f"in [{-(2**63)}, {2**64 - 1}]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("repetition_penalty", NAN, "> 0"),
    ("repetition_penalty", INF, "> 0"),
    ("presence_penalty", 2.5, "in [-2.0, 2.0]"),
    ("presence_penalty", -2.5, "in [-2.0, 2.0]"),
    ("presence_penalty", NAN, "in [-2.0, 2.0]"),
    ("frequency_penalty", 2.01, "in [-2.0, 2.0]"),
    ("frequency_penalty", -INF, "in [-2.0, 2.0]"),
    ("stop_token_ids", (1, -1), "ints >= 0"),
    ("stop_token_ids", (1, True), "ints >= 0"),
    ("stop_token_ids", 5, "ints >= 0"),
    ("stop", ("",), "non-empty strings"),
    ("stop", "###", "non-empty strings"),
    ("stop", (3,), "non-empty strings"),
    ("ignore_eos", 1, "bool"),
    ("logprobs", -1, "in [0, 20]"),
    ("logprobs", 21, "in [0, 20]"),
    ("logprobs", True, "in [0, 20]"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), INVALID)
def test_invalid_value_error_names_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field} must be"), message
    assert allowed in message, message


def test_error_message_shows_the_bad_value():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1\.0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0\.0$"):
        SamplingParams(top_p=0.0)


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(4\), got 5$"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"n": 128, "top_k": -1, "top_p": 1.0, "min_p": 1.0, "logprobs": 0},
        {"temperature": 0, "top_k": 50, "logprobs": 20, "seed": -(2**63)},
        {"seed": 2**64 - 1, "presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 0.01, "stop": ["\n\n", "END"], "stop_token_ids": [0, 7]},
    ],
)
def test_valid_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.logprobs is None and p.ignore_eos is False
    assert p.stop_token_ids == () and p.stop == ()
    assert not p.is_greedy and not p.needs_penalties


def test_values_are_normalised_so_equal_requests_hash_equal():
    a = SamplingParams(temperature=1, stop_token_ids=[1, 2], stop=["x"], repetition_penalty=2)
    b = SamplingParams(temperature=1.0, stop_token_ids=(1, 2), stop=("x",), repetition_penalty=2.0)
    assert type(a.temperature) is float and type(a.repetition_penalty) is float
    assert a.stop_token_ids == (1, 2) and a.stop == ("x",)
    assert a == b and hash(a) == hash(b)


def test_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"temperature": 1e-3}, False),
        ({}, False),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "needs"),
    [
        ({}, False),
        ({"repetition_penalty": 1.1}, True),
        ({"presence_penalty": -0.5}, True),
        ({"frequency_penalty": 0.1}, True),
        ({"min_p": 0.5, "top_k": 3, "temperature": 0.0}, False),
    ],
)
def test_needs_penalties(kwargs, needs):
    assert SamplingParams(**kwargs).needs_penalties is needs


def test_greedy_constructor():
    p = SamplingParams.greedy(max_tokens=7, stop_token_ids=(2,))
    assert p.is_greedy and p.temperature == 0.0
    assert p.max_tokens == 7 and p.stop_token_ids == (2,)


@pytest.mark.parametrize("codec", [msgspec.msgpack, msgspec.json])
def test_round_trips_through_msgspec(codec):
    p = SamplingParams(
        n=3, temperature=0.7, top_k=40, seed=2**64 - 1, stop=("</s>",), stop_token_ids=(2,),
        logprobs=5, presence_penalty=-1.5,
    )
    decoded = codec.decode(codec.encode(p), type=SamplingParams)
    assert decoded == p
    assert isinstance(decoded.stop, tuple) and isinstance(decoded.stop_token_ids, tuple)


def test_decoding_runs_validation():
    wire = msgspec.msgpack.encode({"top_p": 0.0})
    with pytest.raises(msgspec.ValidationError, match="top_p must be in"):
        msgspec.msgpack.decode(wire, type=SamplingParams)
    # ValidationError is a ValueError, so callers need a single except clause.
    assert issubclass(msgspec.ValidationError, ValueError)


def test_decoding_rejects_wrong_types():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"max_tokens": true}', type=SamplingParams)
    decoded = msgspec.json.decode(b'{"temperature": 1}', type=SamplingParams)
    assert decoded.temperature == 1.0 and not math.isnan(decoded.temperature)
