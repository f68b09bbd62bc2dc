"""Cross-run gradient-flow comparison: read runs from any tracker, shape them, draw them.

Readers (`sources`: MLflow, W&B, TensorBoard) produce `RunData` (`data`); `compare` finds
where two runs first part, ranks the layers and says both in JSON and words; `plots` draws
the figures (the flight recorder's windows too); `render` writes the self-contained report;
`live` lets a sink draw its own run's pictures and flight windows.
The `gradtrack` command ties them up.
"""

from gradtrack.report.data import RunData
from gradtrack.report.render import render_report

__all__ = ["RunData", "render_report"]
