"""``hybridzoo.cli_errors.root_cause``: the error reported for a chain of exceptions."""

import json

import pytest

from hybridzoo.cli_errors import root_cause


def raise_clear_error_from_none():
    try:
        json.loads("{bad")
    except json.JSONDecodeError:
        raise ValueError("a.jsonl, line 102: not valid JSON") from None


def test_raise_from_none_is_reported_not_the_suppressed_context():
    """``raise ValueError(clear) from None`` replaced the library's error (itself a ValueError):
    the clear one is reported, as Python's own traceback would show it."""
    with pytest.raises(ValueError) as caught:
        raise_clear_error_from_none()
    assert str(root_cause(caught.value, (ValueError,))) == "a.jsonl, line 102: not valid JSON"


def test_the_innermost_cause_and_unsuppressed_context_are_followed():
    try:
        try:
            raise FileNotFoundError("data path 'x' does not exist")
        except FileNotFoundError as inner:
            raise TypeError("Parser key 'data': Does not validate against any of the Union subtypes") from inner
    except TypeError as error:
        assert isinstance(root_cause(error, (FileNotFoundError,)), FileNotFoundError)
    try:
        try:
            raise ValueError("seq_len must be >= 2")
        except ValueError:
            raise RuntimeError("during instantiation")  # implicit context, not suppressed
    except RuntimeError as error:
        assert str(root_cause(error, (ValueError,))) == "seq_len must be >= 2"
