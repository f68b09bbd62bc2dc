"""The ``gradtrack`` command: compare runs' gradient flow, whatever tracker they were logged to.

    gradtrack compare RUN [RUN ...] [--tracking-uri URI] [--out DIR]
    gradtrack report RUN

A RUN is a W&B offline run directory, ``wandb:entity/project/run_id`` (public API), or an
MLflow run id or ``experiment/run-name``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradtrack.errors import GradtrackError
from gradtrack.report.data import RunData


def read_run(spec: str, tracking_uri: str | None) -> RunData:
    from gradtrack.report.mlflow_source import read_mlflow_run
    from gradtrack.report.wandb_source import read_wandb_api, read_wandb_offline

    if spec.startswith("wandb:"):
        return read_wandb_api(spec[len("wandb:") :], progress=_progress)
    path = Path(spec)
    if path.exists():
        return read_wandb_offline(path, progress=_progress)
    return read_mlflow_run(spec, tracking_uri, progress=_progress)


def _progress(label: str, done: int, total: int) -> None:
    if not sys.stderr.isatty():
        return
    if total:
        filled = int(30 * done / total)
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
    else:
        sys.stderr.write(f"\r{label}: {done} rows")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradtrack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, nargs, help_ in (
        ("compare", "+", "compare the gradient flow of several runs"),
        ("report", 1, "the gradient-flow report of one run"),
    ):
        command = commands.add_parser(name, help=help_)
        command.add_argument("runs", nargs=nargs, metavar="RUN")
        command.add_argument(
            "--tracking-uri",
            help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, then MLflow's)",
        )
        command.add_argument(
            "--out", type=Path, default=Path("gradtrack-report"), help="output folder"
        )
        command.add_argument("--layers", nargs="*", help="layers whose histograms to draw")
    args = parser.parse_args(argv)
    from gradtrack.report.render import render_report

    try:
        runs = [read_run(spec, args.tracking_uri) for spec in args.runs]
        path = render_report(runs, args.out, args.layers)
    except GradtrackError as error:
        print(f"gradtrack: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
