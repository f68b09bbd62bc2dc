"""The module paths of gradtrack 0.1's flat layout, for one release: each old name imports
the module at its new place, with a `DeprecationWarning` that names it.

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     warnings.simplefilter("always")
...     from gradtrack.skip import read_journal
>>> read_journal.__module__
'gradtrack.capture.skip'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# Old path (after ``gradtrack.``) -> new path.
MOVED = {
    "accumulation": "capture.accumulation",
    "actions": "worker.actions",
    "assemble": "worker.assemble",
    "collect": "capture.collect",
    "courier": "delivery.courier",
    "distributed": "capture.distributed",
    "drops": "handoff.drops",
    "evidence": "handoff.evidence",
    "first_mover": "worker.first_mover",
    "flight": "capture.flight_ring",
    "flight_log": "worker.flight_log",
    "histogram": "formats.histogram",
    "hooks": "capture.hooks",
    "latch": "capture.latch",
    "layers": "capture.layers",
    "mailbox": "handoff.mailbox",
    "mesh": "capture.mesh",
    "noise_probes": "capture.noise_probes",
    "noise_scale": "worker.noise_scale",
    "origin": "capture.origin",
    "probes": "capture.probes",
    "progress": "delivery.progress",
    "record": "formats.record",
    "redact": "config.redact",
    "replaced": "capture.replaced",
    "rules": "config.rules",
    "schedule": "capture.schedule",
    "signals": "capture.step_signals",
    "skip": "capture.skip",
    "spike": "capture.spike",
    "spool": "delivery.spool",
    "spool_codec": "delivery.codec",
    "stats": "capture.stats",
    "stepper": "capture.stepper",
    "sync": "delivery.sync",
    "update_sample": "capture.update_sample",
    "updates": "capture.updates",
    "verdict": "capture.verdict",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("gradtrack.") and fullname[len("gradtrack.") :] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = "gradtrack." + MOVED[spec.name[len("gradtrack.") :]]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at its new place is imported already


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
