"""The kernels' on / off settings, read from the environment once, at import (a benchmark compares
two settings in two processes)."""

from __future__ import annotations


def switch(name: str, setting: str, default: bool = False) -> bool:
    """$name's value -> on ("1") or off ("0"); unset or empty, `default`."""
    setting = setting.strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{name}={setting!r}: expected 1 (on), 0 (off) or unset")
    return default if not setting else setting == "1"
