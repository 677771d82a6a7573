"""Bucket planning and the reducer's flat views."""

from __future__ import annotations

import pytest
import torch

from onebit.collectives.bucket import BucketedReducer, plan_buckets


def test_plan_buckets():
    mb = 2**20 // 4  # float32 elements per MiB
    assert plan_buckets([10, 20, 30], 4, 0) == [[0], [1], [2]]
    assert plan_buckets([mb, mb, mb], 4, 2) == [[0, 1], [2]]
    assert plan_buckets([3 * mb, 1, 1], 4, 1) == [[0], [1, 2]]
    assert plan_buckets([0, 5, 0], 4, 1) == [[0, 1, 2]]
    assert plan_buckets([], 4, 1) == []
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        plan_buckets([1], 4, -1)


def test_reducer_views_alias_the_flat_buckets():
    shapes = [torch.Size([3, 2]), torch.Size([]), torch.Size([0]), torch.Size([5])]
    red = BucketedReducer(shapes, torch.device("cpu"), bucket_cap_mb=25.0)
    assert len(red.buckets) == 1 and red.buckets[0].numel == 12
    for i, s in enumerate(shapes):
        assert red.views[i].shape == s
        red.views[i].fill_(i + 1)
    assert red.buckets[0].flat.tolist() == [1.0] * 6 + [2.0] + [4.0] * 5
    avg = red.average(red.buckets[0], [torch.ones(3, 2), None, torch.ones(0), torch.full((5,), 2.0)])
    assert avg.tolist() == [1.0] * 6 + [0.0] + [2.0] * 5  # W = 1: the tensors themselves
