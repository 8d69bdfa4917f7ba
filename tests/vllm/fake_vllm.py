"""A fake of what kvgate's vLLM scheduler plug-in sees of vLLM, for the book's unit tests.

:class:`FakeVllm` keeps requests as vLLM's scheduler does (prompt tokens, computed tokens, output
tokens, a running list, KV blocks of ``block_size`` tokens) and carries out each
:class:`kvgate.vllm.book.StepOrder` the way ``SloScheduler._run`` makes vLLM's
``Scheduler.schedule`` do: the named running requests in order (a decode takes one token, a
prefill at most what is left of its prompt), then the named waiting requests in order (each
starts if its uncached prompt fits in free blocks, taking what budget is left), all within the
order's token budget. A step then "executes": every request whose prompt is done gets a token.
No vLLM needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.slo import Slo
from kvgate.vllm.book import Arrival, Capacity, StepOrder, StepResult, VllmBook


@dataclass
class FakeRequest:
    rid: str
    prompt: int
    max_tokens: int
    cached: int = 0  # what vLLM's prefix cache will give it when it starts
    computed: int = 0
    outputs: int = 0
    running: bool = False
    blocks: int = 0
    finished: bool = False


class FakeVllm:
    def __init__(
        self,
        book: VllmBook,
        *,
        blocks: int = 10_000,
        block_size: int = 16,
        max_tokens: int = 8192,
        max_running: int = 256,
    ) -> None:
        self.book = book
        self.free = blocks
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.max_running = max_running
        self.reqs: dict[str, FakeRequest] = {}
        self.running: list[FakeRequest] = []
        self.waiting: list[FakeRequest] = []
        self.refuse: set[str] = set()  # requests vLLM will not start (e.g. a grammar compiling)
        self.orders: list[StepOrder] = []
        self.steps: list[dict[str, int]] = []
        self.last_planned_ms = 0.0  # the book's plan for the last step (ms)
        self.first_token_at: dict[str, float] = {}

    def add(
        self,
        rid: str,
        prompt: int,
        *,
        slo: Slo,
        now: float,
        max_tokens: int = 4,
        cached: int = 0,
        estimate: int | None = None,
    ) -> str | None:
        r = FakeRequest(rid, prompt, max_tokens, cached=cached)
        self.reqs[rid] = r
        self.waiting.append(r)
        reason = self.book.arrive(
            Arrival(rid, prompt, max_tokens, now, slo, cached if estimate is None else estimate),
            now,
        )
        if reason is not None:
            self.waiting.remove(r)
            del self.reqs[rid]
        return reason

    def capacity(self) -> Capacity:
        return Capacity(
            free_blocks=self.free,
            block_size=self.block_size,
            max_running=self.max_running,
            running=len(self.running),
            max_tokens=self.max_tokens,
        )

    def step(self, now: float, exec_ms: float = 10.0) -> StepOrder:
        """Plan, schedule like vLLM, execute, and report back; the order it carried out."""
        order = self.book.plan(now, self.capacity())
        self.orders.append(order)
        for rid, _ in order.rejected:
            self._drop(self.reqs[rid])
        budget = min(order.token_budget, self.max_tokens)
        tokens: dict[str, int] = {}
        for rid in (*order.decode, *(rid for rid, _ in order.prefill)):
            r = self.reqs.get(rid)
            if r is None or not r.running or rid in tokens or budget <= 0:
                continue
            need = r.prompt + r.outputs - r.computed
            take = min(max(need, 1), budget)
            tokens[rid] = take
            budget -= take
        started: list[str] = []
        for rid in (*order.resume, *order.start):
            r = self.reqs.get(rid)
            if r is None or r.running or budget <= 0 or rid in self.refuse:
                continue
            computed = r.cached if not r.outputs else 0
            need_blocks = -(-(r.prompt + r.outputs - computed + 1) // self.block_size)
            if need_blocks > self.free or len(self.running) >= self.max_running:
                break  # vLLM stops at the first request it cannot allocate
            self.free -= need_blocks
            r.blocks = need_blocks
            r.computed = computed
            r.running = True
            self.waiting.remove(r)
            self.running.append(r)
            take = min(r.prompt + r.outputs - computed, budget)
            tokens[rid] = take
            budget -= take
            started.append(rid)
        for rid, n in tokens.items():
            self.reqs[rid].computed += n
        self.book.after_schedule(
            StepResult(
                tokens=tokens,
                computed={rid: self.reqs[rid].computed for rid in tokens},
                started=started,
            ),
            now,
        )
        self.steps.append(tokens)
        self.last_planned_ms = self.book.step_executed(exec_ms)
        end = now + exec_ms / 1000.0
        for rid in tokens:
            r = self.reqs[rid]
            if r.computed >= r.prompt + r.outputs:
                r.outputs += 1
                r.computed = r.prompt + r.outputs - 1  # the new token is not computed yet
                self.first_token_at.setdefault(rid, end)
                self.book.on_output(rid, 1, end)
                if r.outputs >= r.max_tokens:
                    self._drop(r)
                    self.book.finish(rid, end)
        return order

    def evict(self, rid: str, now: float) -> None:
        """vLLM's recompute preemption of a running request (KV pressure)."""
        r = self.reqs[rid]
        self.running.remove(r)
        self.free += r.blocks
        r.running, r.computed, r.blocks = False, 0, 0
        self.waiting.insert(0, r)
        self.book.after_schedule(StepResult(tokens={}, computed={}, evicted=[rid]), now)

    def _drop(self, r: FakeRequest) -> None:
        r.finished = True
        if r.running:
            self.running.remove(r)
            self.free += r.blocks
        elif r in self.waiting:
            self.waiting.remove(r)
        self.reqs.pop(r.rid, None)

    def run(self, until: float, dt_ms: float = 10.0, start: float = 0.0) -> float:
        """Step every ``dt_ms`` from ``start`` while there is work, up to ``until``."""
        t = start
        while t < until and (self.running or self.waiting):
            self.step(t, dt_ms)
            t += dt_ms / 1000.0
        return t
