"""What the scheduler predicts and what the simulated GPU spends, both from one cost profile.

Two different questions, kept apart on purpose (as in FlowPrefill):

* *execution* time is the cost profile itself (:mod:`kvgate.cost_model`): a prefill batch of
  pieces ``(n_i new tokens after c_i cached)`` costs the profile's base curve at the batch's total
  new tokens plus each piece's own attention term (:func:`prefill_batch_ms`);
* *prediction* is what the scheduler believes before running: FlowPrefill's TTFT predictor, a
  cubic polynomial in tokens fit by least squares (:class:`TtftPredictor`). It is deliberately
  the paper's approximation, not an oracle, so the scheduler's decisions can be wrong as a real
  engine's can.

Least squares is done here in plain Python (modified Gram-Schmidt QR on scaled columns): the
matrices are at most a few columns wide, and the engine avoids a numpy dependency.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

from kvgate.cost_model import CostProfile


def least_squares(
    rows: Sequence[Sequence[float]],
    targets: Sequence[float],
    weights: Sequence[float] | None = None,
) -> list[float]:
    """``x`` minimising ``sum w_i (rows_i . x - targets_i)^2``; raises ValueError if ill-posed.

    Columns are scaled to unit max before a twice-orthogonalised modified Gram-Schmidt QR, so
    polynomial columns spanning many orders of magnitude (n, n^2, n^3) stay well conditioned.
    """
    m = len(rows)
    if m == 0:
        raise ValueError("least squares needs at least one row")
    n = len(rows[0])
    if m < n:
        raise ValueError(f"least squares needs at least {n} rows for {n} unknowns, got {m}")
    w = [1.0] * m if weights is None else [math.sqrt(max(float(x), 0.0)) for x in weights]
    cols = [[float(r[j]) * w[i] for i, r in enumerate(rows)] for j in range(n)]
    y = [float(t) * w[i] for i, t in enumerate(targets)]
    scale = [max((abs(v) for v in c), default=0.0) or 1.0 for c in cols]
    cols = [[v / s for v in c] for c, s in zip(cols, scale, strict=True)]
    q: list[list[float]] = []
    r = [[0.0] * n for _ in range(n)]
    for j in range(n):
        v = cols[j][:]
        for _ in range(2):  # re-orthogonalise once: cheap insurance against cancellation
            for i in range(j):
                d = _dot(q[i], v)
                r[i][j] += d
                v = [a - d * b for a, b in zip(v, q[i], strict=True)]
        norm = math.sqrt(_dot(v, v))
        if norm < 1e-12 * math.sqrt(m):
            raise ValueError("least squares: the columns are linearly dependent (rank deficient)")
        r[j][j] = norm
        q.append([a / norm for a in v])
    qty = [_dot(qi, y) for qi in q]
    x = [0.0] * n
    for j in reversed(range(n)):
        x[j] = (qty[j] - sum(r[j][k] * x[k] for k in range(j + 1, n))) / r[j][j]
    return [xj / s for xj, s in zip(x, scale, strict=True)]


def nonnegative_least_squares(
    rows: Sequence[Sequence[float]], targets: Sequence[float]
) -> list[float]:
    """:func:`least_squares` with every coefficient >= 0: the least-squares fit on each subset
    of the columns (the others 0) whose coefficients are all >= 0, the one with the smallest
    residual (exact; 2^n fits, for the few columns of a cost model). A time that falls as a
    load grows is no engine's: fitted freely on a tiny model's noisy steps, the decode cost per
    request and token came out negative, the step of a long context negative too, and the
    router priced such requests below nothing. Raises ValueError if no subset is well posed."""
    n = len(rows[0]) if rows else 0
    best: list[float] | None = None
    best_res = math.inf
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        try:
            sub = least_squares([[r[j] for j in cols] for r in rows], targets)
        except ValueError:
            continue
        if any(x < 0.0 for x in sub):
            continue
        coef = [0.0] * n
        for j, x in zip(cols, sub, strict=True):
            coef[j] = x
        res = math.fsum((_dot(r, coef) - t) ** 2 for r, t in zip(rows, targets, strict=True))
        if res < best_res:
            best, best_res = coef, res
    if best is None:
        raise ValueError("no non-negative least-squares fit: the columns are rank deficient")
    return best


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def prefill_batch_ms(profile: CostProfile, pieces: Iterable[tuple[int, int]]) -> float:
    """Execution time of one prefill batch of ``(new_tokens, context_tokens)`` pieces, in ms.

    The dense (GEMM) part is shared: the profile's curve at the batch's total new tokens. The
    attention part is per sequence: ``prefill(n_i, c_i) - prefill(n_i, 0)`` for each piece.
    A single piece costs exactly ``profile.prefill_ms(n, c)``.
    """
    total = 0
    attn = 0.0
    for n, c in pieces:
        total += n
        if c > 0:
            attn += profile.prefill_ms(n, c) - profile.prefill_ms(n, 0)
    return profile.prefill_ms(total, 0) + attn


@dataclass(frozen=True, slots=True)
class TtftPredictor:
    """FlowPrefill's TTFT predictor: ``max(c0 + c1 x + c2 x^2 + c3 x^3, floor)``, ``x = n/scale``.

    Fit with :meth:`fit` from a cost profile (relative-error least squares over an even grid of
    token counts; within a few percent of the default profile from 256 to 32K tokens).
    """

    coef: tuple[float, float, float, float]
    scale: float
    floor_ms: float

    def __call__(self, tokens: float) -> float:
        """Predicted prefill time of ``tokens`` new tokens, in ms (0 for none)."""
        if tokens <= 0:
            return 0.0
        x = tokens / self.scale
        c0, c1, c2, c3 = self.coef
        return max(c0 + x * (c1 + x * (c2 + x * c3)), self.floor_ms)

    @classmethod
    def fit(cls, profile: CostProfile, max_tokens: int = 32768, points: int = 128) -> TtftPredictor:
        """Fit the cubic to ``profile.prefill_ms(n, 0)`` on an even grid of n up to max_tokens,
        minimising relative error; below the grid's first point the floor takes over."""
        grid = sorted({max(1, max_tokens * i // points) for i in range(1, points + 1)})
        samples = [(n, profile.prefill_ms(n, 0)) for n in grid]
        # A prefill never costs less than a one-token one (profiles are checked to grow with
        # tokens; the floor keeps the cubic from dipping below it at the grid's low end).
        floor = profile.prefill_ms(1, 0) or min((ms for _, ms in samples if ms > 0), default=1.0)
        scale = float(max_tokens)
        rows = [(1.0, n / scale, (n / scale) ** 2, (n / scale) ** 3) for n, _ in samples]
        weights = [1.0 / max(ms, floor) ** 2 for _, ms in samples]
        coef = least_squares(rows, [ms for _, ms in samples], weights)
        return cls((coef[0], coef[1], coef[2], coef[3]), scale, floor)


@cache
def cached_predictor(profile: CostProfile, max_tokens: int) -> TtftPredictor:
    """The predictor of ``profile`` fit up to ``max_tokens``, fit once per process."""
    return TtftPredictor.fit(profile, max_tokens)
