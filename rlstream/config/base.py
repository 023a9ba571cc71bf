"""What every config section shares: the strict model base, the one error type, the bounds on
a config's size, and reading a JSON file a config names."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot be used. The message names the field, the value and what is allowed."""


class Strict(BaseModel):
    # allow_inf_nan=False: .inf/.nan are refused everywhere; each number also has a sane upper bound
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


MAX_CONFIG_BYTES = 1 << 20
"""A config file, or a DeepSpeed JSON it names, larger than this is refused before parsing."""
MAX_CONFIG_VALUES = 100_000
"""Values a config may hold once YAML aliases are expanded (an alias bomb is refused)."""
MAX_CONFIG_DEPTH = 64
DAY_S = 86400.0


def read_json_file(path: str | Path, field: str) -> Any:
    """A JSON file named by a config field, refused unless it is a regular file of at most
    :data:`MAX_CONFIG_BYTES` (``/dev/zero`` or a FIFO would never end)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{field}: {path} is not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{field}: {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB ({st.st_size} bytes)")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{field}: {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{field}: {path} is not valid JSON: {exc}") from None
    check_expansion(data, f"{field} ({path})")
    return data


def check_expansion(data: Any, source: str) -> None:
    """Refuse data whose YAML aliases expand past :data:`MAX_CONFIG_VALUES` values or nest past
    :data:`MAX_CONFIG_DEPTH` (a self-referencing alias nests forever).

    PyYAML shares an aliased node instead of copying it, so loading a "billion laughs" file is
    cheap; what explodes is anything that walks it (overrides, validation, config.resolved.json).
    This walk counts every visit, shared or not, and stops at the bound, so it costs at most
    MAX_CONFIG_VALUES steps.
    """
    seen = 0
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES or depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source}: YAML aliases expand to more than {MAX_CONFIG_VALUES} values or nest deeper "
                              f"than {MAX_CONFIG_DEPTH} levels; refused")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            seen += len(node)  # the keys
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
