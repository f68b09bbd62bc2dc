"""`Check`: what every rule family works with — the rules per layer and the cooldowns."""

from __future__ import annotations

from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.rulebook import RuleBook


class Check:
    """A rule family of an `AlertEngine`: its rules come from ``book``, its events from
    ``cooldowns`` (both shared by every family of the engine)."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        self.book = book
        self.cooldowns = cooldowns
