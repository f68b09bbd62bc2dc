"""Alert rules as pydantic models: thresholds, patience, cooldown, severity and action.

`AlertRules` is the ``alerts`` field of `GradtrackConfig`; ``layers`` overrides any rule's
fields for layers matching a glob pattern.
"""

from __future__ import annotations

import fnmatch
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
Action = Literal["log", "warn", "raise"]


class Rule(BaseModel):
    """Fields every rule has."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    severity: Severity = "warning"
    action: Action = Field("log", description="log: sinks only; warn: also warnings; raise: stop")
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
    """A layer's norm above ``ratio`` × its running average, after ``warmup`` logged steps."""

    ratio: PositiveFloat = 10.0
    warmup: NonNegativeInt = 20
    ema_decay: float = Field(0.9, gt=0, lt=1)


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
    layers: dict[str, dict[str, dict[str, Any]]] = Field(
        default_factory=dict, description="{glob: {rule: {field: value}}}, first match wins"
    )

    @model_validator(mode="after")
    def _check_overrides(self) -> AlertRules:
        for pattern, rules in self.layers.items():
            for name, fields in rules.items():
                if name not in RULE_TYPES:
                    known = ", ".join(RULE_TYPES)
                    raise ValueError(f"layers[{pattern!r}]: unknown rule {name!r}; rules: {known}")
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

    def actions(self) -> set[str]:
        actions = {getattr(self, name).action for name in RULE_TYPES}
        for rules in self.layers.values():
            actions |= {fields["action"] for fields in rules.values() if "action" in fields}
        return actions
