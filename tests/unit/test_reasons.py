"""The reason codes (`opfuse.fusion.reasons`): one documented, fixed set, and what a Reason gives its readers."""

import re

import pytest

from opfuse.fusion import reasons
from opfuse.fusion.reasons import Code, Reason


def test_the_docstring_documents_exactly_the_codes():
    """The module docstring is where the codes are explained: every code is there, and nothing else."""
    documented = re.findall(r"^  ([a-z][a-z-]*)(?:, ([a-z][a-z-]*))?\s{2,}", reasons.__doc__, re.MULTILINE)
    names = [name for pair in documented for name in pair if name]
    assert sorted(set(names)) == sorted(code.value for code in Code)


def test_a_reason_is_its_code_and_its_words():
    reason = Reason("several-users", "conv has several users: relu, sigmoid")
    assert reason.code is Code.SEVERAL_USERS and reason.code == "several-users"
    assert str(reason) == f"{reason}" == "conv has several users: relu, sigmoid"
    assert reason.to_dict() == {"code": "several-users", "reason": "conv has several users: relu, sigmoid"}
    assert reason == Reason(Code.SEVERAL_USERS, reason.text)
    with pytest.raises(ValueError, match="no-such-code"):
        Reason("no-such-code", "an unknown code is a bug")
