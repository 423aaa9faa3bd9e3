"""The base of a method's or quantizer's own options: a small frozen dataclass that a policy stage
carries as `stage.options` (`kvjax.compress.policy`), written `key=value` after the stage's budget."""

from __future__ import annotations

import dataclasses

from kvjax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Options:
    """No options; a method with options subclasses this with its fields and their defaults, and checks
    their values in `check`."""

    def check(self, where: str) -> None:
        """Raise a ConfigError naming the field, its value and what is allowed (before any compute)."""

    def at_least_one(self, where: str, *names: str) -> None:
        """The check of integer options that count something: each of `names` must be >= 1."""
        for name in names:
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: {name}={getattr(self, name)} must be >= 1")
