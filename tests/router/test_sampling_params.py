"""SamplingParams refuses what the engine cannot take, with messages that name the field."""

import pytest

from router.sampling_params import MAX_N, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": 2**64},
     "seed must be a 64-bit integer, in [-2**63, 2**64), got 18446744073709551616"),
    ({"seed": -(2**63) - 1},
     "seed must be a 64-bit integer, in [-2**63, 2**64), got -9223372036854775809"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"top_p": float("nan")}, "top_p must be a finite number, got nan"),
    ({"min_p": float("-inf")}, "min_p must be a finite number, got -inf"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number, got inf"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number, got nan"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty must be a finite number, got inf"),
    ({"n": 0}, "n must be in [1, 128], got 0"),
    ({"n": MAX_N + 1}, "n must be in [1, 128], got 129"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop may hold at most 32 strings, got 33"),
    ({"stop": ["ok", "y" * (MAX_STOP_LENGTH + 1)]},
     "stop strings may be at most 256 characters long, got one of 257"),
])
def test_out_of_range_values_are_refused(kwargs, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == message


def test_the_limits_themselves_are_accepted():
    # manual_seed takes both ends of the signed and the unsigned 64-bit range
    for seed in (-(2**63), -1, 0, 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed
    assert SamplingParams(n=MAX_N).n == MAX_N
    stops = ["z" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS
    assert SamplingParams(stop=stops).stop == tuple(stops)
