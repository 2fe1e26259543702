"""Read a YAML recipe, apply `key=value` overrides and validate it (`megarl.checks` then checks it against the model).

Errors are raised as `ConfigError` with one line per problem, each naming the dotted field and
what to do about it, so `megarl train` fails before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from megarl.config.schema import Config


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field(s) and the fix."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML, so numbers, bools and lists are typed)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form section.field=value (e.g. sync.interval=4)")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<config>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (misspelt? see the field list in megarl/config/schema.py)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  {where}: {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


def validate(data: dict[str, Any]) -> Config:
    """The config of `data` (no torch is imported: the preflight checks validate configs too)."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load `path` (YAML) with overrides applied; raises ConfigError on any problem."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist: pass --config with a file from configs/")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {p} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(loaded).__name__}")
        data = loaded or {}
    return validate(apply_overrides(data, overrides or []))


def save_config(cfg: Config, path: Path) -> Path:
    """Write the resolved config as YAML (what every role of a job reads back with `load_config`)."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
