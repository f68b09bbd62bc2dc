"""A module or parameter of the watched model replaced after `gradtrack.watch`, said once.

gradtrack watches the parameters the model had at ``watch``; one assigned later
(``model.head = nn.Linear(…)``, a new ``nn.Parameter``) would silently fall out of the records.
Two of torch's global registration hooks see such an assignment as it happens, at no cost to
the steps.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle


class ReplacementCheck:
    """Warns once when a module of ``model`` gets a new submodule or parameter."""

    def __init__(self, model: nn.Module) -> None:
        self._paths: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary(
            {module: name for name, module in model.named_modules()}
        )
        self.warned = False
        self.handles: list[RemovableHandle] = [
            register_module_module_registration_hook(self._registered),
            register_module_parameter_registration_hook(self._registered),
        ]

    def _registered(self, module: nn.Module, name: str, value: Any) -> None:
        path = self._paths.get(module)
        if path is None or self.warned or value is None:
            return
        self.warned = True
        where = f"{path}.{name}" if path else name
        try:  # a warning turned into an error must not stop the user's assignment
            warnings.warn(
                f"{where} was assigned after gradtrack.watch: gradtrack watches the parameters "
                "the model had then, so its gradients are not in the records; call "
                "gradtrack.unwatch(model) and watch it again after changing the model",
                RuntimeWarning,
                stacklevel=3,
            )
        except Exception:
            pass
