"""The settings package: the one typed settings model and what checks it.

- `schema`: `Settings` and its sections (server, auth, limits, reload, health), read from a YAML
  profile, then `LLM_GATEWAY_*` environment variables, then CLI flags; `load_settings`;
- `engine`: the `engine` section (`EngineProfile`), what vLLM's engine is built from;
- `keys_file`: the tenants' keys file (named keys, limits, budgets), checked with the settings;
- `checks`: checks against the machine (GPUs visible) and warnings that need more than the model.

The names most callers need are importable from here.
"""

from server.settings.engine import EngineProfile
from server.settings.schema import (
    AuthSettings,
    ConfigFileError,
    HealthSettings,
    LimitSettings,
    ReloadSettings,
    ServerSettings,
    Settings,
    load_settings,
)

__all__ = [
    "AuthSettings",
    "ConfigFileError",
    "EngineProfile",
    "HealthSettings",
    "LimitSettings",
    "ReloadSettings",
    "ServerSettings",
    "Settings",
    "load_settings",
]
