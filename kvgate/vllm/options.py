"""The scheduler plug-in's settings: vLLM's ``--additional-config '{"kvgate": {...}}'``, then
``KVGATE_*`` environment variables for what the JSON leaves out. Pure (the caller passes the
environment); a bad value raises :class:`OptionsError` naming the field, so vLLM fails at start
with the reason instead of scheduling with a setting nobody asked for.

=====================  ==========================  ===============================================
key                    environment                 meaning
=====================  ==========================  ===============================================
``profile``            ``KVGATE_PROFILE``          cost profile (name in kvgate/profiles or a
                                                   path; ``NAME@xK``); default mistral-7b-a6000
``default_slo``        ``KVGATE_DEFAULT_SLO``      class of requests that state no SLO (relaxed)
``reject``             ``KVGATE_REJECT``           refuse requests whose TTFT can no longer be met
                                                   (finish_reason ``abort``); default off: they
                                                   queue behind feasible work
``broker``             ``KVGATE_BROKER_URL``       Redis URL: publish events (off when unset)
``broker_prefix``      ``KVGATE_BROKER_PREFIX``    key prefix (``kvgate:``)
``url``                ``KVGATE_ENGINE_URL``       this engine's OpenAI base URL as the gateway
                                                   reaches it (needed with ``broker``)
``engine_id``          ``KVGATE_ENGINE_ID``        stream name (default ``vllm-HOST-PORT``)
``models``             ``KVGATE_MODELS``           served model names (default vLLM's)
``model_dir``          ``KVGATE_MODEL_DIR``        tokenizer folder for KV events (default vLLM's)
``heartbeat_s``        ``KVGATE_HEARTBEAT_S``      least time between load heartbeats (0.05)
``stats_s``            ``KVGATE_STATS_S``          interval of the counters' log line (60)
``max_step_ms``        ``KVGATE_MAX_STEP_MS``      longest prefill step on the profile (100; 0:
                                                   off): vLLM preempts only between steps
``fit_speed``          ``KVGATE_FIT_SPEED``        fit the profile's speed and a per-step overhead
                                                   to the steps' run time (default on)
``scheduler``          (none)                      SchedulerConfig fields: token_budget,
                                                   min_slack_frac, tpot_guard, chunk_tokens,
                                                   layers, vbs_safety, vbs_margin
=====================  ==========================  ===============================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from engine.scheduler.state import SchedulerConfig
from kvgate.cost_model import DEFAULT_PROFILE
from kvgate.slo import DEFAULT_SLO_CLASS, SLO_CLASSES

CONFIG_KEY = "kvgate"
SCHEDULER_FIELDS = (
    "token_budget",
    "min_slack_frac",
    "tpot_guard",
    "chunk_tokens",
    "layers",
    "vbs_safety",
    "vbs_margin",
)
_ENV = {
    "profile": "KVGATE_PROFILE",
    "default_slo": "KVGATE_DEFAULT_SLO",
    "reject": "KVGATE_REJECT",
    "broker": "KVGATE_BROKER_URL",
    "broker_prefix": "KVGATE_BROKER_PREFIX",
    "url": "KVGATE_ENGINE_URL",
    "engine_id": "KVGATE_ENGINE_ID",
    "models": "KVGATE_MODELS",
    "model_dir": "KVGATE_MODEL_DIR",
    "heartbeat_s": "KVGATE_HEARTBEAT_S",
    "stats_s": "KVGATE_STATS_S",
    "max_step_ms": "KVGATE_MAX_STEP_MS",
    "fit_speed": "KVGATE_FIT_SPEED",
}


class OptionsError(ValueError):
    """A setting of the scheduler plug-in that is not valid (the text names it)."""


@dataclass(frozen=True, slots=True)
class PluginOptions:
    """Everything the plug-in reads from vLLM's command line and the environment."""

    profile: str = DEFAULT_PROFILE
    default_slo: str = DEFAULT_SLO_CLASS
    reject: bool = False
    broker: str | None = None
    broker_prefix: str = "kvgate:"
    url: str | None = None
    engine_id: str | None = None
    models: tuple[str, ...] = ()
    model_dir: str | None = None
    heartbeat_s: float = 0.05
    stats_s: float = 60.0
    max_step_ms: float = 100.0
    fit_speed: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def reporting(self) -> bool:
        return self.broker is not None

    def stream_id(self) -> str:
        """The engine's stream name: ``engine_id``, else ``vllm-HOST-PORT`` of ``url``."""
        if self.engine_id:
            return self.engine_id
        parts = urlsplit(self.url or "")
        host = (parts.hostname or "localhost").replace(":", "-")
        return f"vllm-{host}-{parts.port or 80}"


def parse_options(
    additional_config: Mapping[str, Any] | None, env: Mapping[str, str]
) -> PluginOptions:
    """The options (see the module docstring); raises OptionsError with the reason."""
    raw = (additional_config or {}).get(CONFIG_KEY) or {}
    if not isinstance(raw, Mapping):
        raise OptionsError(f"--additional-config {CONFIG_KEY!r} must be a JSON object")
    known = {f.name for f in fields(PluginOptions)}
    unknown = set(raw) - known
    if unknown:
        raise OptionsError(
            f"unknown kvgate option(s) {', '.join(sorted(map(str, unknown)))} "
            f"(known: {', '.join(sorted(known))})"
        )
    values: dict[str, Any] = {}
    for name, var in _ENV.items():
        if name in raw:
            values[name] = raw[name]
        elif env.get(var):
            values[name] = env[var]
    opts = PluginOptions(
        profile=_text(values, "profile", DEFAULT_PROFILE),
        default_slo=_slo_class(values.get("default_slo", DEFAULT_SLO_CLASS)),
        reject=_flag(values.get("reject", False), "reject"),
        broker=_opt_text(values, "broker"),
        broker_prefix=_text(values, "broker_prefix", "kvgate:"),
        url=_url(values.get("url")),
        engine_id=_opt_text(values, "engine_id"),
        models=_models(values.get("models")),
        model_dir=_opt_text(values, "model_dir"),
        heartbeat_s=_seconds(values.get("heartbeat_s", 0.05), "heartbeat_s", 0, 60),
        stats_s=_seconds(values.get("stats_s", 60.0), "stats_s", 1, 3600),
        max_step_ms=_ms(values.get("max_step_ms", 100.0)),
        fit_speed=_flag(values.get("fit_speed", True), "fit_speed"),
        scheduler=_scheduler(raw.get("scheduler")),
    )
    if opts.broker is not None and opts.url is None:
        raise OptionsError(
            "kvgate option 'broker' needs 'url' (or KVGATE_ENGINE_URL): the OpenAI base URL "
            "the gateway reaches this engine at, e.g. http://10.0.0.5:8000"
        )
    return opts


def _text(values: Mapping[str, Any], name: str, default: str) -> str:
    v = values.get(name, default)
    if not isinstance(v, str) or not v.strip():
        raise OptionsError(f"kvgate option {name!r} must be a non-empty string")
    return v.strip()


def _opt_text(values: Mapping[str, Any], name: str) -> str | None:
    return _text(values, name, "") if name in values else None


def _slo_class(v: Any) -> str:
    if not isinstance(v, str) or v.strip().lower() not in SLO_CLASSES:
        raise OptionsError(f"kvgate option 'default_slo' must be one of {', '.join(SLO_CLASSES)}")
    return v.strip().lower()


def _flag(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no"):
        return v.strip().lower() in ("1", "true", "yes", "on")
    raise OptionsError(f"kvgate option {name!r} must be true or false")


def _url(v: Any) -> str | None:
    if v is None:
        return None
    parts = urlsplit(v) if isinstance(v, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise OptionsError(f"kvgate option 'url' must be an http(s) URL, got {v!r}")
    return v.rstrip("/")


def _models(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not all(isinstance(m, str) for m in items):
        raise OptionsError("kvgate option 'models' must be a list of names (or a comma list)")
    return tuple(m.strip() for m in items if m.strip())


def _seconds(v: Any, name: str, low: float, high: float) -> float:
    try:
        s = float(v)
    except (TypeError, ValueError):
        raise OptionsError(f"kvgate option {name!r} must be a number of seconds") from None
    if not low <= s <= high:
        raise OptionsError(f"kvgate option {name!r} must be in [{low:g}, {high:g}] seconds")
    return s


def _ms(v: Any) -> float:
    try:
        ms = float(v)
    except (TypeError, ValueError):
        raise OptionsError("kvgate option 'max_step_ms' must be a number of ms") from None
    if not 0 <= ms <= 60_000:
        raise OptionsError("kvgate option 'max_step_ms' must be in [0, 60000] ms (0: no cap)")
    return ms


def _scheduler(v: Any) -> SchedulerConfig:
    if v is None:
        return SchedulerConfig()
    if not isinstance(v, Mapping):
        raise OptionsError("kvgate option 'scheduler' must be a JSON object")
    unknown = set(v) - set(SCHEDULER_FIELDS)
    if unknown:
        raise OptionsError(
            f"unknown kvgate scheduler field(s) {', '.join(sorted(map(str, unknown)))} "
            f"(known: {', '.join(SCHEDULER_FIELDS)})"
        )
    base = SchedulerConfig()
    changes: dict[str, Any] = {}
    for name, value in v.items():
        kind = type(getattr(base, name))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OptionsError(f"kvgate scheduler field {name!r} must be a number")
        if kind is int and value != int(value):
            raise OptionsError(f"kvgate scheduler field {name!r} must be an integer")
        changes[name] = kind(value)
    try:
        return replace(base, **changes)
    except ValueError as exc:
        raise OptionsError(f"kvgate scheduler fields: {exc}") from None
