"""zerofn.testing: tree assertions that name the failing leaf."""

from __future__ import annotations

import pytest
import torch

from zerofn import testing as zt


def test_close_equal_and_their_messages():
    a = {"w": torch.ones(3), "b": [torch.zeros(2, dtype=torch.float64)]}
    # within the default tolerance (atol 1e-6 + rtol 1e-6 x 1) but not equal: 1 + 1e-6 is a distinct float32
    near = {"w": torch.ones(3) + 1e-6, "b": [torch.zeros(2, dtype=torch.float64)]}
    assert not torch.equal(near["w"], a["w"])
    zt.assert_trees_all_close(a, near)
    with pytest.raises(AssertionError, match="leaf w differs at flat index 0"):
        zt.assert_trees_all_equal(a, near)  # bit for bit: the same difference fails
    with pytest.raises(AssertionError, match="leaf w differs at flat index 0"):  # just beyond the tolerance
        zt.assert_trees_all_close(a, {"w": torch.ones(3) + 3e-6, "b": [torch.zeros(2, dtype=torch.float64)]})
    zt.assert_trees_all_equal(a, {"w": torch.ones(3), "b": [torch.zeros(2, dtype=torch.float64)]})
    with pytest.raises(AssertionError, match=r"leaf b\[0\] differs at flat index 1: 0.0 against 0.5"):
        zt.assert_trees_all_close(a, {"w": torch.ones(3), "b": [torch.tensor([0.0, 0.5], dtype=torch.float64)]})
    with pytest.raises(AssertionError, match="leaf w has dtype torch.float32 against torch.float64"):
        zt.assert_trees_all_equal(
            a, {"w": torch.ones(3, dtype=torch.float64), "b": [torch.zeros(2, dtype=torch.float64)]}
        )
    with pytest.raises(AssertionError, match=r"leaf w has shape \[3\] against \[4\]"):
        zt.assert_trees_all_equal_shapes(a, {"w": torch.ones(4), "b": [torch.zeros(2)]})
    with pytest.raises(AssertionError, match="tree structures differ"):
        zt.assert_trees_all_equal_structs(a, {"w": torch.ones(3)})
    zt.assert_trees_all_close({"n": torch.tensor(float("nan"))}, {"n": torch.tensor(float("nan"))})
    with pytest.raises(AssertionError, match="leaf n differs"):  # nan matches nan only
        zt.assert_trees_all_close({"n": torch.tensor(float("nan"))}, {"n": torch.tensor(0.0)})


def test_all_finite():
    zt.assert_tree_all_finite({"a": torch.ones(2), "i": torch.arange(3)})
    with pytest.raises(AssertionError, match="leaf a holds inf or nan"):
        zt.assert_tree_all_finite({"a": torch.tensor([1.0, float("inf")])})
