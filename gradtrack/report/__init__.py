"""Cross-run gradient-flow comparison: read runs from any tracker, shape them, draw them.

Readers (`mlflow_source`, `wandb_source`) produce `RunData`; `compare` ranks layers; `plots`
draws figures; `html` writes the self-contained report. The `gradtrack` command ties them up.
"""

from gradtrack.report.data import RunData
from gradtrack.report.render import render_report

__all__ = ["RunData", "render_report"]
