"""Reading a true/false ``kv_connector_extra_config`` key strictly: a value that is not a JSON
boolean is refused by name, not taken for its truthiness."""

from __future__ import annotations

from typing import Any


def strict_bool(
    kv_transfer_config: Any, key: str, default: bool, meaning: str, error: type = ValueError
) -> bool:
    """``key`` from ``kv_transfer_config``'s extra config, ``default`` when unset; raises
    ``error`` naming the key and the value for anything but true or false (``meaning`` says
    what each does)."""
    value = kv_transfer_config.get_from_extra_config(key, default)
    if not isinstance(value, bool):
        raise error(
            f"kv_connector_extra_config {key} is {value!r}; expected true or false ({meaning})"
        )
    return value
