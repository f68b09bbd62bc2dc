"""Cross-run gradient-flow comparison: read runs from any tracker, shape them, draw them.

Readers (`sources`: MLflow, W&B, TensorBoard) produce `RunData`; `divergence` finds where two runs
first part, `compare` ranks layers, `summary` says both in JSON and words; `plots` draws
figures; `render` writes the self-contained report; `live` lets a sink draw its own run's.
The `gradtrack` command ties them up.
"""

from gradtrack.report.data import RunData
from gradtrack.report.render import render_report

__all__ = ["RunData", "render_report"]
