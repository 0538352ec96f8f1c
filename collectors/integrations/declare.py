"""What an integration tells a session about the framework it runs under: the framework and its
installed release, and the settings its mismatch figures read, taken from the framework's own config
object (``GRPOConfig``, an OmegaConf node, a dataclass), so the figures isoaudit shows under the
framework's names follow that release's code and settings (:mod:`isoaudit.audit.frameworks`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from isoaudit.audit.frameworks import REQUIRED, framework_table, parse_declaration

log = logging.getLogger(__name__)


def _setting(source: Any, key: str) -> Any:
    if isinstance(source, Mapping):
        return source.get(key, REQUIRED)
    return getattr(source, key, REQUIRED)


def declaration_args(framework: str, version: str | None, config: Any = None) -> dict[str, Any]:
    """Session arguments declaring ``framework`` at ``version``, with every setting its figures read
    that ``config`` holds (attributes or keys of the framework's config names). Empty, with a warning,
    when isoaudit does not cover that release: the figures then follow the framework's newest code."""
    table = framework_table(framework)
    spec = f"{table.name}=={version}" if version else table.name
    try:
        era = parse_declaration(spec).era
    except ValueError as exc:
        log.warning("isoaudit: %s; %s's figures follow its newest code", exc, table.name)
        return {}
    settings = {}
    for key in era.defaults:
        value = _setting(config, key) if config is not None else REQUIRED
        if value is not REQUIRED and isinstance(value, str | int | float | bool | type(None)):
            settings[key] = value
    return {"framework": spec, "framework_config": settings}
