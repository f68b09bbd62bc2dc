"""Alert rules as pydantic models: thresholds, patience, cooldown, severity and action.

`AlertRules` is the ``alerts`` field of `GradtrackConfig`; ``layers`` overrides any rule's
fields for layers matching a glob pattern.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

Severity = Literal["info", "warning", "error"]
Action = Literal["log", "warn", "raise", "skip"]
# Rules whose finding is one step's gradient, so that the step can be left out of training.
SKIPPABLE = ("nonfinite", "spike", "exploding")


class Rule(BaseModel):
    """Fields every rule has."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    severity: Severity = "warning"
    action: Action = Field(
        "log",
        description="log: sinks only; warn: also warnings; raise: stop; skip: leave the "
        "optimizer step out (nonfinite, spike, exploding only)",
    )
    cooldown_steps: NonNegativeInt = Field(
        100, description="After an event, the same rule and layer stay quiet this many steps."
    )


class NonFiniteRule(Rule):
    """Any NaN or Inf in a layer's gradient or the total norm."""

    severity: Severity = "error"


class ExplodingRule(Rule):
    """A layer's norm, or the total norm, above ``threshold``."""

    threshold: PositiveFloat = 1e3


class VanishingRule(Rule):
    """A layer's norm below ``threshold`` for ``patience`` logged steps in a row."""

    threshold: PositiveFloat = 1e-7
    patience: PositiveInt = 10


class SpikeRule(Rule):
    """The total or a layer's gradient norm ``z`` standard deviations above its mean over the
    last ``window`` steps (log scale, every step, on the device: `gradtrack.capture.spike`) and
    above
    ``ratio`` × its typical norm there, once ``warmup`` steps are in the window. ``window`` and
    ``warmup`` are the rule's alone (one window for all layers): no per-layer override."""

    z: PositiveFloat = 6.0
    ratio: float = Field(3.0, ge=1.0)
    window: int = Field(128, ge=2, le=100_000)
    warmup: PositiveInt = 32


class UpdateRatioRule(Rule):
    """With the update signals: a layer's update/weight ratio ‖ΔW‖/‖W‖ above ``high`` (it
    learns too fast) or below ``low`` but not zero (barely at all; not a layer whose gradient
    is exactly zero: that is the ``dead`` rule's), for ``patience`` logged steps in a row. The
    usual healthy scale is around 1e-3."""

    high: PositiveFloat = 0.1
    low: PositiveFloat = 1e-6
    patience: PositiveInt = 3


class LearningRateRule(Rule):
    """The learning rate named as the cause, from the update signals: a logged step whose
    median layer moved by more than ``oversized`` × its weights' norm (healthy ≈ 1e-3), or
    layers whose gradient had been flowing and is now (as good as) zero right after updates
    above ``elevated`` × their weights (at the last ``lookback`` logged steps and this one) —
    a collapse."""

    oversized: PositiveFloat = Field(
        1.0, description="Median layer's update/weight ratio at one logged step."
    )
    elevated: PositiveFloat = Field(
        0.01, description="Update/weight ratio before a collapse that names the learning rate."
    )
    lookback: PositiveInt = Field(
        3, description="Logged steps before a collapse whose update ratios are its evidence."
    )


class DeadRule(Rule):
    """A layer whose gradient is exactly zero for ``patience`` logged steps in a row."""

    patience: PositiveInt = 10


class JumpRule(Rule):
    """Gradient flow breaks between two depths: every layer of a kind (module type) on one
    side has a gradient RMS (norm per √element) ``ratio`` times below every layer of that kind
    on the other side. Like is compared with like — Linear with Linear, LayerNorm with
    LayerNorm — and embeddings (row-sparse gradients) are left out."""

    ratio: PositiveFloat = 100.0


class FlowRule(Rule):
    """Gradual vanishing or exploding along depth: the gradient RMS of the first layers of
    the model's most common kind over its last layers' below ``1/ratio`` (vanishing) or above
    ``ratio`` (exploding), for ``patience`` logged steps in a row."""

    ratio: PositiveFloat = 1e3
    patience: PositiveInt = 3


class AmpRule(Rule):
    """GradScaler overflow: a skipped step is ``info``; ``max_skips`` in a row is ``error``."""

    severity: Severity = "error"
    max_skips: PositiveInt = 5
    cooldown_steps: NonNegativeInt = 0


RULE_TYPES: dict[str, type[Rule]] = {
    "nonfinite": NonFiniteRule,
    "exploding": ExplodingRule,
    "vanishing": VanishingRule,
    "spike": SpikeRule,
    "dead": DeadRule,
    "jump": JumpRule,
    "flow": FlowRule,
    "amp": AmpRule,
    "update_ratio": UpdateRatioRule,
    "learning_rate": LearningRateRule,
}


class AlertRules(BaseModel):
    """Every rule, plus per-layer overrides by glob pattern.

    >>> rules = AlertRules(layers={"encoder.*": {"vanishing": {"threshold": 1e-9}}})
    >>> rules.for_layer("vanishing", "encoder.0").threshold, rules.vanishing.threshold
    (1e-09, 1e-07)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    nonfinite: NonFiniteRule = NonFiniteRule()
    exploding: ExplodingRule = ExplodingRule()
    vanishing: VanishingRule = VanishingRule()
    spike: SpikeRule = SpikeRule()
    dead: DeadRule = DeadRule()
    jump: JumpRule = JumpRule()
    flow: FlowRule = FlowRule()
    amp: AmpRule = AmpRule()
    update_ratio: UpdateRatioRule = UpdateRatioRule()
    learning_rate: LearningRateRule = LearningRateRule()
    layers: dict[str, dict[str, dict[str, Any]]] = Field(
        default_factory=dict, description="{glob: {rule: {field: value}}}, first match wins"
    )

    @model_validator(mode="after")
    def _check_overrides(self) -> AlertRules:
        for name in RULE_TYPES:
            _check_skippable(name, getattr(self, name).action, name)
        for pattern, rules in self.layers.items():
            for name, fields in rules.items():
                if name not in RULE_TYPES:
                    known = ", ".join(RULE_TYPES)
                    raise ValueError(f"layers[{pattern!r}]: unknown rule {name!r}; rules: {known}")
                _check_skippable(name, fields.get("action"), f"layers[{pattern!r}].{name}")
                shared = {"window", "warmup"} & set(fields) if name == "spike" else set()
                if shared:
                    raise ValueError(
                        f"layers[{pattern!r}].spike: {', '.join(sorted(shared))} apply to every "
                        "layer (one window); set them on the spike rule itself"
                    )
                base = getattr(self, name).model_dump()
                try:
                    RULE_TYPES[name](**{**base, **fields})
                except ValidationError as exc:
                    problems = "; ".join(
                        f"{'.'.join(map(str, e['loc']))} = {e['input']!r}: {e['msg']}"
                        for e in exc.errors()
                    )
                    raise ValueError(f"layers[{pattern!r}].{name}: {problems}") from None
        return self

    def for_layer(self, name: str, layer: str | None) -> Any:
        """The rule ``name`` as it applies to ``layer`` (None: the total norm)."""
        rule = getattr(self, name)
        if layer is None:
            return rule
        for pattern, rules in self.layers.items():
            if name in rules and fnmatch.fnmatchcase(layer, pattern):
                return type(rule)(**{**rule.model_dump(), **rules[name]})
        return rule

    def skip_rules(self) -> tuple[str, ...]:
        """The rules whose action is ``skip`` (by the rule, or for some layer)."""
        return self.with_action("skip", SKIPPABLE)

    def with_action(self, action: str, among: Sequence[str] = tuple(RULE_TYPES)) -> tuple[str, ...]:
        """The rules of ``among`` whose action is ``action`` (by the rule, or for some layer).

        >>> AlertRules(vanishing={"action": "raise"}).with_action("raise")
        ('vanishing',)
        """
        named = {name for name in among if getattr(self, name).action == action}
        for rules in self.layers.values():
            named |= {name for name, fields in rules.items() if fields.get("action") == action}
        return tuple(name for name in among if name in named)

    def actions(self) -> set[str]:
        actions = {getattr(self, name).action for name in RULE_TYPES}
        for rules in self.layers.values():
            actions |= {fields["action"] for fields in rules.values() if "action" in fields}
        return actions


def _check_skippable(rule: str, action: str | None, where: str) -> None:
    if action == "skip" and rule not in SKIPPABLE:
        raise ValueError(
            f"{where}.action = 'skip': only {', '.join(SKIPPABLE)} can skip a step (their "
            "finding is one step's gradient); allowed actions here: log, warn, raise"
        )
