"""Hand validation of the inference bodies (``proxy/validation.py``): what the fuzzer found."""

from __future__ import annotations

import pytest

from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.validation import parse_chat


@pytest.mark.parametrize("role", [{}, [], ["user"], 1, None])
def test_a_role_that_is_not_a_name_is_a_400(role: object) -> None:
    """A dict or list role was looked up in the set of roles: TypeError, a 500."""
    with pytest.raises(OpenAIError) as e:
        parse_chat({"model": "m", "messages": [{"role": role, "content": "hi"}]})
    assert e.value.status == 400 and e.value.param == "messages[0].role"


def test_a_named_role_passes() -> None:
    parsed = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert parsed.messages == [{"role": "user", "content": "hi"}]
