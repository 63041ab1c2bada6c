"""The weight-swap routes' bodies (``api/weights.py``): bounds the fuzzer found missing."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tracegym.gateway.api.weights import BucketIn, GroupInitIn

GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}


@pytest.mark.parametrize("change", [{"world_size": 2**64}, {"rank_offset": 2**31}, {"master_port": True},
                                    {"world_size": "2"}])
def test_group_sizes_are_32_bit_json_integers(change: dict) -> None:
    """A world size past 64 bits reached the upstream request's JSON encoder: a 500."""
    with pytest.raises(ValidationError):
        GroupInitIn(**GROUP | change)
    assert GroupInitIn(**GROUP).world_size == 2


@pytest.mark.parametrize("shapes", [[[-1]], [[True]], [[2**64]]])
def test_bucket_shapes_are_sizes(shapes: list) -> None:
    with pytest.raises(ValidationError):
        BucketIn(names=["w"], dtypes=["bfloat16"], shapes=shapes)
    assert BucketIn(names=["w"], dtypes=["bfloat16"], shapes=[[2, 3]]).shapes == [[2, 3]]
