"""The one typed settings model: YAML file, then ``LLM_GATEWAY_*`` environment, then CLI flags.

Precedence (highest first): CLI flags > environment > YAML file > defaults. Nested fields are
reached from the environment with ``__``, e.g. ``LLM_GATEWAY_ENGINE__MAX_MODEL_LEN=4096``.
Cross-field rules run when the model is built, before any engine loads, and name the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from server.settings.engine import EMBEDDED_MODEL, EngineProfile, detect_device
from server.settings.keys_file import check_overlaps, load_keys_file

EMBEDDED_MODEL_DIRNAME = "smollm2-135m-instruct"

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
"""The shipped profiles (links to configs/*.yaml, packaged with the gateway)."""

DEFAULT_PROFILES = {"cpu": "embedded-cpu.yaml", "gpu": "gemma4-e2b-h200.yaml"}
"""The profile `llm-gateway serve` uses without --config or $LLM_GATEWAY_CONFIG, by device
(the same choice `make serve` makes)."""

class ServerSettings(BaseModel):
    """Where and how the HTTP server listens."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Address to bind. Keep loopback unless a proxy (nginx) or firewall sits in front."""

    port: int = Field(8000, ge=0, le=65535)
    """TCP port to bind (0 picks a free one, which is then logged)."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the gateway and uvicorn."""

    state_dir: Path = Path(".state")
    """Directory for the embedded model, vLLM's cache, RPC sockets and temp files."""

    drain_timeout_s: float = Field(30.0, ge=0)
    """On shutdown, how long in-flight requests may run before they are aborted."""

    keep_alive_timeout_s: float = Field(75.0, gt=0)
    """Idle keep-alive timeout; longer than nginx's upstream keepalive_timeout (60 s)."""

    max_header_bytes: int = Field(32 * 1024, ge=1024)
    """Largest request head (request line and headers) accepted; 431 above. nginx's default
    `large_client_header_buffers 4 8k` allows the same 32 KiB."""

    freeze_gc_heap: bool = True
    """Once the engine is up (and after each reload), freeze the startup heap out of Python's
    garbage collector, as `vllm serve` does, so full collections stop pausing the event loop for
    up to about half a second each (server/runner/gc_heap.py; measured in
    docs/performance/event-loop.md). Off only to measure what it saves."""

    gc_refreeze_max_wait_s: float = Field(300.0, ge=0)
    """After a reload, the refreeze (one full collection, ~0.6 s of event loop on the H200) waits
    for a moment with no request in flight, at most this long; then it runs under load. 0: at once."""

    replicas: int = Field(1, ge=1)
    """Gateway processes, each with its own engine, behind nginx on `host:port` (`llm-gateway serve`
    runs them: server/replicas/). On a GPU each takes 1/N of `engine.gpu_memory_utilization` less 0.07
    (what an engine holds past vLLM's own accounting). 1: one process, no nginx. `serve --replicas N`
    overrides it."""

    replicas_fill_first: int = Field(0, ge=0)
    """With `replicas` > 1: nginx sends every request to the first replica until it has this many
    open, and only the overflow to the others (server/replicas/front.py: `max_conns` on the first,
    the others `backup`). On a GPU two engines' steps over half a batch each cost more GPU time than
    one engine's step over the whole batch until the batch is large (measured in
    docs/performance/replicas.md), so a small load is best served by one engine. 0: least_conn over
    every replica from the first request. A first replica that refuses (reloading, restarting) sends
    each request on to the others."""

    cuda_mps: bool = False
    """With `replicas` > 1 on a GPU, run the replicas as clients of one CUDA MPS control daemon,
    which the supervisor starts (its pipe and log folders under the state dir) and stops, so that
    their kernels share the GPU at once instead of taking turns (server/replicas/mps.py; measured in
    docs/performance/replicas.md). Needs `nvidia-cuda-mps-control`, which comes with the NVIDIA
    driver. A GPU fault in one replica then ends the others' work too (they are started again).
    Ignored with one replica and on CPU; the systemd instances of `deploy/install.sh
    --replicas-per-gpu` do not use it."""

    warmup: bool | None = None
    """Before an engine takes traffic (at start and after a drain-swap or blue-green reload), run a
    few requests of the shapes traffic brings through it (a long prompt, then a batch of short ones;
    server/lifecycle/warmup.py), so kernels compiled on first use (Triton's attention on the GPU) are
    not compiled during a client's request. None: on a GPU, off on CPU (no such kernels there)."""


class AuthSettings(BaseModel):
    """API keys. No key configured means open access (warned about off loopback)."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[str] = Field(default_factory=list)
    """Keys accepted as `Authorization: Bearer <key>` on the API routes."""

    api_key_file: Path | None = None
    """A file with more API keys, one per line (`#` comments allowed)."""

    admin_keys: list[str] = Field(default_factory=list)
    """Keys for /admin/* (reload, status). Without one, /admin/* is open only when no API key is set."""

    admin_key_file: Path | None = None
    """A file with more admin keys, one per line."""

    open_paths: list[str] = Field(default_factory=lambda: ["/health", "/ready", "/metrics"])
    """Paths served without a key (probes and scraping); /docs and /openapi.json are not listed by default."""

    keys_file: Path | None = None
    """YAML keys file: named keys (tenants) with rate limits, concurrency, token budgets and
    allowed models (README, "Tenants"). Re-read on SIGHUP and POST /admin/reload."""

    redis_url: str | None = None
    """Share the tenants' limits and budgets between instances through this Redis, e.g.
    `redis://127.0.0.1:6379/0` (`rediss://` for TLS). None: each instance counts on its own."""

    redis_key_prefix: str = Field("llm-gateway", min_length=1)
    """Prefix of every Redis key the gateway writes (several deployments can share one Redis)."""

    redis_timeout_s: float = Field(0.25, gt=0)
    """Longest a Redis call may take; then the request is decided without Redis."""

    redis_retry_s: float = Field(5.0, gt=0)
    """After a Redis failure, how long limits are counted per instance before Redis is tried again."""

    concurrency_lease_s: float = Field(900.0, gt=0)
    """With Redis: how long a request holds its `max_concurrent` slot if its instance dies before
    giving it back (keep it above the longest request)."""

    end_streams_over_budget: bool = False
    """End a stream with a final SSE error event (`insufficient_quota`) once it runs over its
    tenant's budget. Off: it finishes and the budget goes negative by what it ran over."""

    fair_share: bool = True
    """With a keys file: when the engine is full (as many sequences running as the profile's
    `max_num_seqs`), further generation requests wait in the gateway, and each free place goes to
    the active tenant that has received the least service per unit of its `share` (a Virtual
    Token Counter, `server.tenants.fair_queue`). A light tenant then waits for one free place,
    not behind a heavy tenant's whole queue. The wait counts against
    limits.first_token_timeout_s. Off: every request goes straight to vLLM's own queue."""

    usage_db: Path | None = None
    """SQLite usage store (per tenant and UTC day); None: `<server.state_dir>/usage.sqlite3`.
    Used only with a keys file; instances on one host may share it."""

    usage_flush_interval_s: float = Field(1.0, gt=0)
    """How often usage counted in memory is written to the usage store."""

    def usage_path(self, state_dir: Path) -> Path:
        return self.usage_db if self.usage_db is not None else Path(state_dir) / "usage.sqlite3"

    def _read(self, inline: list[str], path: Path | None) -> list[str]:
        keys = [k for k in inline if k]
        if path is not None:
            for line in Path(path).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return keys

    def resolved_api_keys(self) -> list[str]:
        return self._read(self.api_keys, self.api_key_file)

    def resolved_admin_keys(self) -> list[str]:
        return self._read(self.admin_keys, self.admin_key_file)


class LimitSettings(BaseModel):
    """Per-request limits, each answered with an OpenAI-shaped error."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 above)."""

    max_n: int = Field(16, ge=1)
    """Largest `n` (choices per prompt)."""

    max_prompts_per_request: int = Field(64, ge=1)
    """Most prompts in one /v1/completions request (a list of strings or token-id lists)."""

    max_in_flight: int = Field(0, ge=0)
    """Most generation requests admitted at once (0 = no limit); beyond it 429 + Retry-After.
    vLLM's own queue cap (`max_num_queued_reqs`) can be set with engine.extra_engine_args."""

    request_timeout_s: float | None = Field(None, gt=0)
    """Total time a generation may take before it is aborted with a 504 (None = no limit)."""

    first_token_timeout_s: float | None = Field(None, gt=0)
    """Time to the first generated token before the request is aborted with a 504."""


class ReloadSettings(BaseModel):
    """Hot reload of the engine profile (SIGHUP, POST /admin/reload, or a config file change)."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["drain-swap", "blue-green", "in-place"] = "drain-swap"
    """`drain-swap` (one engine fits: requests queue while the engine restarts), `blue-green`
    (two engines fit: the new one starts beside the old, no request waits) or `in-place` (only
    the weights change: the running engine pauses, loads the new `engine.model` directory's
    safetensors, and resumes; seconds, no engine start). In-place refuses any other change."""

    in_place_mode: Literal["keep", "finish-old"] = "keep"
    """What an in-place reload does with requests in flight. `keep`: they pause and resume, and
    their later tokens come from the new weights (their earlier tokens are recomputed with the
    new weights, since the pause clears the KV cache); the pause is short whatever runs. `finish-
    old`: new requests wait in the reload queue while the in-flight ones finish on the old weights
    (up to `drain_timeout_s`), then the swap; every answer comes from one version, and the wait
    is as long as the longest request in flight."""

    in_place_prefetch: bool = True
    """Read the new weights into memory (pinned on a GPU) before an in-place reload pauses, so
    the pause covers only their copy into the model, not the file read. Costs host memory the
    size of the checkpoint during the reload; requests keep running while it is read."""

    in_place_prefetch_timeout_s: float = Field(300.0, gt=0)
    """Longest the prefetch may take; after it (or if it fails) the reload reads the files
    during the pause, as vLLM does."""

    drain_timeout_s: float = Field(30.0, ge=0)
    """How long the old engine's requests may run on; the rest are aborted with a clear error."""

    queue_size: int = Field(256, ge=0)
    """Requests that may wait for a drain-swap reload; more get 503 + Retry-After. 0: none waits,
    each gets 503 at once (what `serve --replicas` gives each replica: nginx resends it to another)."""

    queue_max_wait_s: float = Field(180.0, gt=0)
    """Longest a queued request waits for the new engine before 503 + Retry-After."""

    watch_config: bool = False
    """Reload when the config file changes (polled)."""

    watch_interval_s: float = Field(2.0, gt=0)
    """How often the config file's modification time is checked."""


class HealthSettings(BaseModel):
    """The stall rule: an engine with work pending that produces no output for too long."""

    model_config = ConfigDict(extra="forbid")

    stall_timeout_s: float | None = Field(None, ge=0)
    """Seconds with requests pending in the engine and no engine output before the engine counts
    as stalled (/health 503, requests failed, `on_stall`). None picks by device: 60 s on GPU, 300 s
    on CPU, where one engine step of a large model can take tens of seconds. 0 turns the rule off;
    the systemd watchdog pings still stop after WatchdogSec/2 without progress."""

    on_stall: Literal["exit", "report"] = "exit"
    """`exit`: fail the requests, stop the engine processes and exit with code 3, so systemd's
    `Restart=on-failure` brings a fresh process. `report`: fail the requests and answer 503 on
    /health and to new requests, but keep the process (and the stalled engine) for debugging; it
    serves again if the engine moves again."""

    exit_delay_s: float = Field(2.0, ge=0)
    """With `on_stall: exit`, how long /health answers 503 before the process exits, so probes
    and load balancers see the stall rather than only a closed port."""

    def resolved_stall_timeout_s(self, device: Literal["cpu", "gpu"]) -> float:
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return 60.0 if device == "gpu" else 300.0


class Settings(BaseSettings):
    """Everything the gateway reads at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="LLM_GATEWAY_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    profile_file: ClassVar[Path | None] = None
    """The YAML file `load_settings` reads (set on a throwaway subclass, not a field)."""

    server: ServerSettings = Field(default_factory=ServerSettings)
    """HTTP server settings."""

    auth: AuthSettings = Field(default_factory=AuthSettings)
    """API keys and open paths."""

    limits: LimitSettings = Field(default_factory=LimitSettings)
    """Per-request limits."""

    reload: ReloadSettings = Field(default_factory=ReloadSettings)
    """Hot reload strategy and limits."""

    health: HealthSettings = Field(default_factory=HealthSettings)
    """When a stalled engine is reported and what the process then does."""

    engine: EngineProfile = Field(default_factory=EngineProfile)
    """The vLLM engine profile."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlProfileSource(settings_cls, settings_cls.profile_file))

    @model_validator(mode="after")
    def _tenant_rules(self) -> Settings:
        auth = self.auth
        if auth.keys_file is None:
            if auth.redis_url:
                raise ValueError("auth.redis_url shares tenant limits, but no auth.keys_file names any "
                                 "tenant: set auth.keys_file, or drop auth.redis_url")
            return self
        try:
            check_overlaps(load_keys_file(auth.keys_file), auth.resolved_api_keys(), auth.resolved_admin_keys())
        except (ValueError, OSError) as exc:  # OSError: auth.api_key_file cannot be read
            raise ValueError(f"auth.keys_file: {exc}") from None
        return self

    @property
    def served_model_name(self) -> str:
        if self.engine.served_model_name:
            return self.engine.served_model_name
        return Path(self.engine.model.rstrip("/")).name or self.engine.model

    def model_path(self) -> str:
        """The model directory or hub id vLLM loads, with `embedded` resolved."""
        if self.engine.model == EMBEDDED_MODEL:
            return str(embedded_model_dir(self.server.state_dir).resolve())
        return self.engine.model

    def summary(self) -> dict[str, Any]:
        """The effective profile, for the start-up log and /admin/status."""
        return {
            "served_model_name": self.served_model_name,
            "model": self.model_path(),
            **self.engine.model_dump(exclude={"model", "served_model_name", "env"}),
        }


class ConfigFileError(ValueError):
    """The config file cannot be read as a YAML profile (not the same as an invalid setting)."""


class _YamlProfileSource(PydanticBaseSettingsSource):
    """The profile's YAML file, with errors that say what is wrong with the file.

    pydantic-settings' own YAML source lets reader errors (binary files, /proc files), parser
    errors and non-mapping documents escape as bare YAML or ValueError exceptions.
    """

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False  # unused: __call__ returns the whole mapping

    def __call__(self) -> dict[str, Any]:
        return read_profile_file(self.path) if self.path is not None else {}


def read_profile_file(path: Path) -> dict[str, Any]:
    """The YAML mapping in `path`; ConfigFileError names the file and the problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"config file {path} is not UTF-8 text") from exc
    except OSError as exc:
        raise ConfigFileError(f"config file {path} cannot be read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigFileError(f"config file {path} is not valid YAML{at}: {problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(
            f"config file {path} must hold a mapping of sections (server, engine, ...), "
            f"not a {type(data).__name__}"
        )
    return data


def default_profile_path() -> Path:
    """The shipped profile for this machine's device (see DEFAULT_PROFILES)."""
    return PROFILES_DIR / DEFAULT_PROFILES[detect_device()]


def embedded_model_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "models" / EMBEDDED_MODEL_DIRNAME


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Nested override dicts: `extra` wins key by key, sub-dicts are merged, not replaced."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from a YAML file (or ``$LLM_GATEWAY_CONFIG``, or the shipped default profile
    for this machine's device), the environment and overrides.

    ``overrides`` are nested dicts (``server={"port": 9000}``) and win over everything else.
    Raises FileNotFoundError for a missing file, ConfigFileError for one that is not a YAML
    profile, and pydantic's ValidationError for invalid settings.
    """
    path = config_file or os.environ.get("LLM_GATEWAY_CONFIG") or default_profile_path()
    if not Path(path).exists():
        raise FileNotFoundError(f"config file not found: {path}")
    if not Path(path).is_file():
        raise ConfigFileError(f"config file {path} is not a regular file")

    class _FromFile(Settings):
        profile_file = Path(path)

    loaded = _FromFile(**{k: v for k, v in overrides.items() if v is not None})
    # Re-validate as the public class so callers never see the throwaway subclass.
    return Settings.model_validate(loaded.model_dump())
