import pytest

from rpn import RPNError, evaluate


def test_add():
    assert evaluate("1 2 +") == 3.0


def test_nested():
    assert evaluate("5 1 2 + 4 * + 3 -") == 14.0


def test_negative_and_decimal():
    assert evaluate("-3 0.5 *") == -1.5


def test_power():
    assert evaluate("2 10 ^") == 1024.0


def test_error_is_value_error():
    assert issubclass(RPNError, ValueError)


@pytest.mark.parametrize("expr", ["", "1 +", "1 2", "1 x +", "1 0 /"],
                         ids=["empty", "too_few", "leftover", "unknown", "div_zero"])
def test_errors(expr):
    with pytest.raises(RPNError):
        evaluate(expr)
