"""amax_gain on hand-made matrices."""

import numpy as np
import pytest

from mhc.diagnostics import amax_gain


def test_identity_has_gain_one():
    h = np.broadcast_to(np.eye(4), (3, 5, 4, 4))
    forward, backward = amax_gain(h)
    np.testing.assert_allclose(forward, 1.0)
    np.testing.assert_allclose(backward, 1.0)


def test_permutation_has_gain_one():
    perm = np.eye(3)[[2, 0, 1]]
    forward, backward = amax_gain(np.broadcast_to(perm, (4, 2, 3, 3)))
    np.testing.assert_allclose(forward, 1.0)
    np.testing.assert_allclose(backward, 1.0)


def test_scaled_matrix_compounds_with_depth():
    forward, backward = amax_gain(np.broadcast_to(2.0 * np.eye(2), (3, 1, 2, 2)))
    np.testing.assert_allclose(forward, [2.0, 4.0, 8.0])
    np.testing.assert_allclose(backward, [2.0, 4.0, 8.0])


def test_row_and_column_sums_follow_the_transpose():
    # H_res = [[1, 1], [0, 0]]: A = H_res^T = [[1, 0], [1, 0]]: rows of A sum to 1, columns to
    # (2, 0), so the forward gain is 1 and the backward gain 2.
    forward, backward = amax_gain(np.array([[[[1.0, 1.0], [0.0, 0.0]]]]))
    np.testing.assert_allclose(forward, [1.0])
    np.testing.assert_allclose(backward, [2.0])


def test_mean_over_tokens_and_negative_entries():
    h = np.stack([np.eye(2), -3.0 * np.eye(2)])[None]  # one layer, two tokens
    forward, _ = amax_gain(h)
    np.testing.assert_allclose(forward, [2.0])


def test_bad_shape():
    with pytest.raises(ValueError, match="h_res_per_layer"):
        amax_gain(np.zeros((2, 3, 3)))
