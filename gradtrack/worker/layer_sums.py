"""Per-tensor rows the training thread handed on, summed into layers on the worker."""

from __future__ import annotations

import numpy as np

from gradtrack.formats.record import root_sum_squares


def rank_layer_norms(
    local_norms: np.ndarray, tensor_layer: np.ndarray, n_layers: int
) -> np.ndarray:
    """[ranks, tensors] local tensor norms → [ranks, layers] local layer norms."""
    return np.sqrt(
        np.stack([np.bincount(tensor_layer, row * row, minlength=n_layers) for row in local_norms])
    )


def layer_update_norms(
    rows: np.ndarray, tensor_layer: np.ndarray, n_layers: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer (every layer): ‖W‖ and ‖ΔW‖ from the per-tensor rows of `UpdateProbe.after`.

    >>> layer_update_norms(np.array([[3.0, 0.3], [4.0, 0.4]]), np.array([0, 0]), 1)
    (array([5.]), array([0.5]))
    """
    return (
        root_sum_squares(rows[:, 0], tensor_layer, n_layers),
        root_sum_squares(rows[:, 1], tensor_layer, n_layers),
    )
