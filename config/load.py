"""Build an EngineConfig from layered sources.

Layers, each deep-merged over the previous one:
1. `default.toml` beside this module (every key, with its default);
2. the TOML file at `path`, if given;
3. environment variables `TOKENLOOM_<SECTION>__<KEY>` (e.g. `TOKENLOOM_SCHEDULER__MAX_NUM_SEQS=8`),
   values parsed as TOML scalars and otherwise taken as strings (string-typed keys always
   take the raw string);
4. `overrides`, as dotted keys (`{"scheduler.max_num_seqs": 8}`) or nested mappings.

Every problem — unreadable file, unknown section or key, wrong type, out-of-range value,
violated cross-field rule — is raised as `ConfigError` naming the dotted key and what is allowed.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from tokenloom.config.schema import ConfigError, EngineConfig, check_field, field_types

__all__ = ["DEFAULT_TOML", "ENV_PREFIX", "config_to_dict", "env_overrides", "load_config"]

DEFAULT_TOML = Path(__file__).with_name("default.toml")
ENV_PREFIX = "TOKENLOOM_"

Tree = dict[str, Any]


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = os.environ,
) -> EngineConfig:
    """Defaults → file → environment → overrides, validated into a frozen EngineConfig.

    Pass `env=None` (or `{}`) to ignore the environment, as tests usually should.
    """
    tree = _read_toml(DEFAULT_TOML)
    if path is not None:
        _merge(tree, _read_toml(Path(path)))
    if env:
        _merge(tree, env_overrides(env))
    if overrides:
        _merge(tree, _nest(overrides))
    _check_tree(tree)
    try:
        return msgspec.convert(tree, EngineConfig)
    except msgspec.ValidationError as e:
        # A cross-field ConfigError raised in __post_init__ arrives wrapped by msgspec.
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        # _check_tree should have caught everything else; keep msgspec's words, our key style.
        message = re.sub(r" - at `\$\.?(.*)`$", r" (at \1)", str(e))
        raise ConfigError(message) from e


def config_to_dict(cfg: EngineConfig) -> dict[str, dict[str, Any]]:
    """The config as plain nested dicts (section → key → value), e.g. for logging or stats;
    `load_config(overrides=config_to_dict(cfg), env=None) == cfg`."""
    return msgspec.to_builtins(cfg)


def env_overrides(env: Mapping[str, str]) -> Tree:
    """The nested overrides named by `TOKENLOOM_<SECTION>__<KEY>` variables in `env`.

    Variables without the `__` separator are not config and are ignored.
    """
    sections = _sections()
    tree: Tree = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        section, sep, key = name.removeprefix(ENV_PREFIX).lower().partition("__")
        if not sep:
            continue
        cls = sections.get(section)
        is_str = cls is not None and isinstance(
            field_types(cls).get(key), msgspec.inspect.StrType
        )
        tree.setdefault(section, {})[key] = raw if is_str else _parse_scalar(raw)
    return tree


def _parse_scalar(raw: str) -> Any:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    # Only scalars: `[a]` or `{...}` in an environment variable is more likely a string.
    return raw if isinstance(value, (list, dict)) else value


def _read_toml(path: Path) -> Tree:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from e


def _nest(overrides: Mapping[str, Any]) -> Tree:
    """{"a.b": 1, "c": {"d": 2}} → {"a": {"b": 1}, "c": {"d": 2}}."""
    tree: Tree = {}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted} conflicts with a value set for {part}")
        _merge(node, {leaf: _nest(value) if isinstance(value, Mapping) else value})
    return tree


def _merge(base: Tree, top: Mapping[str, Any]) -> None:
    """Deep-merge `top` into `base` in place: tables merge, anything else replaces."""
    for key, value in top.items():
        if isinstance(value, Mapping):
            if not isinstance(base.get(key), dict):
                base[key] = {}
            _merge(base[key], value)
        else:
            base[key] = value


def _sections() -> dict[str, type[msgspec.Struct]]:
    return {name: t.cls for name, t in field_types(EngineConfig).items()}


def _check_tree(tree: Tree) -> None:
    """Reject unknown sections/keys and bad values with our messages, before msgspec sees them."""
    sections = _sections()
    for section, table in tree.items():
        cls = sections.get(section)
        if cls is None:
            allowed = ", ".join(sections)
            raise ConfigError(f"unknown section {section} (allowed: {allowed})", key=section)
        if not isinstance(table, Mapping):
            raise ConfigError(f"{section} must be a table, got {table!r}", key=section)
        fields = field_types(cls)
        for key, value in table.items():
            if key not in fields:
                allowed = ", ".join(fields)
                raise ConfigError(
                    f"unknown key {section}.{key} (allowed: {allowed})", key=f"{section}.{key}"
                )
            check_field(cls, key, value)
