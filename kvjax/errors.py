"""What kvjax raises for input it cannot accept, and the checks that build those messages: every error
names the field, the bad value and what is allowed, before any compute. `kvjax.config` and the layer
kinds' own config sections (`kvjax.kinds`) both check with these."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value or file that kvjax cannot accept; the message says which and why."""


class Note(UserWarning):
    """Something kvjax did differently from what was asked, for a good reason the message gives (a
    warning, so library users can filter it; the command line prints it as one `kvjax: note:` line)."""


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise `field=value <allowed>` unless `ok`."""
    if not ok:
        raise ConfigError(f"{field}={value!r} {allowed}")


def positive(section: str, config: Any, *names: str, optional: bool = False) -> None:
    """Each named field of `config` must be > 0 (or, `optional`, null)."""
    for name in names:
        value = getattr(config, name)
        if not (optional and value is None):
            require(value > 0, f"{section}.{name}", value, "must be > 0" + (", or null" if optional else ""))
