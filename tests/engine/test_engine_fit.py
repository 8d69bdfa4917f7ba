"""``kvgate engine fit-profile`` recovers known coefficients."""

from __future__ import annotations

import random

import orjson
import pytest

from engine.cli import add_arguments, run
from engine.fit import FitError, fit_profile, read_samples
from kvgate.cost_model import CostProfile, default_profile, load_profile


def _rows(noise: float, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    rows = []
    for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192):
        for c in (0, 1000, 4000):
            ms = 5.0 + 0.05 * n + 2e-6 * n * n + 3e-4 * c + 1e-6 * n * c
            rows.append(
                {"new_tokens": n, "context_tokens": c, "prefill_ms": ms + rng.gauss(0, noise)}
            )
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        for L in (100, 1000, 4000):
            ms = 2e-5 * b * L + 0.1 * b + 1e-3 * L + 12.0
            rows.append({"batch": b, "mean_context": L, "step_ms": ms + rng.gauss(0, noise)})
    return [orjson.dumps(r) for r in rows]


def test_fit_recovers_known_coefficients() -> None:
    profile, quality = fit_profile(read_samples(_rows(0.0)), "gpu-x", default_profile())
    assert profile.segments[0].coef == pytest.approx((5.0, 0.05, 2e-6), rel=1e-6)
    assert (profile.attn_c, profile.attn_nc) == pytest.approx((3e-4, 1e-6), rel=1e-6)
    assert (profile.decode_a, profile.decode_b, profile.decode_c, profile.decode_d) == (
        pytest.approx((2e-5, 0.1, 1e-3, 12.0), rel=1e-6)
    )
    assert quality["prefill_rms_ms"] < 1e-6 and quality["decode_rms_ms"] < 1e-6
    assert profile.prefill_ms(3000, 500) == pytest.approx(
        5 + 0.05 * 3000 + 2e-6 * 3000**2 + 3e-4 * 500 + 1e-6 * 3000 * 500
    )


def test_fit_with_noise_stays_close() -> None:
    profile, _ = fit_profile(read_samples(_rows(0.2)), "gpu-x", default_profile())
    assert profile.prefill_ms(4096, 0) == pytest.approx(5 + 0.05 * 4096 + 2e-6 * 4096**2, rel=0.01)
    assert profile.decode_step_ms(64, 2000) == pytest.approx(
        2e-5 * 64 * 2000 + 6.4 + 2.0 + 12.0, rel=0.02
    )


def test_fit_errors_name_the_line() -> None:
    with pytest.raises(FitError, match="line 2"):
        read_samples([b'{"batch": 1, "mean_context": 1, "ms": 1}', b"{"])
    with pytest.raises(FitError, match="line 1"):
        read_samples([b'{"new_tokens": -5, "prefill_ms": 1}'])
    with pytest.raises(FitError, match="at least 4 decode rows"):
        fit_profile(read_samples(_rows(0.0)[:24]), "x", default_profile())


def test_fit_profile_cli_writes_a_loadable_profile(tmp_path) -> None:
    import argparse

    src = tmp_path / "t.jsonl"
    src.write_bytes(b"\n".join(_rows(0.0)))
    out = tmp_path / "gpu-x.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["fit-profile", str(src), "--name", "gpu-x", "--out", str(out)])
    assert run(args) == 0
    loaded = load_profile(str(out))
    assert isinstance(loaded, CostProfile) and loaded.name == "gpu-x"
    assert loaded.decode_d == pytest.approx(12.0)


def test_a_fit_whose_prefill_curve_turns_down_is_refused() -> None:
    rows = [
        orjson.dumps({"new_tokens": n, "prefill_ms": 5.0 + 0.05 * n - 1e-5 * n * n})
        for n in (64, 256, 1024, 2048, 4096)
    ]
    rows += _rows(0.0)[24:]  # the decode rows
    with pytest.raises(FitError, match="prefill-degree 1"):
        fit_profile(read_samples(rows), "bent", default_profile())
    profile, _ = fit_profile(read_samples(rows), "straight", default_profile(), prefill_degree=1)
    assert profile.prefill_ms(8192) > profile.prefill_ms(4096)


def test_decode_fit_keeps_every_coefficient_non_negative() -> None:
    """Steps whose free fit has a negative per-request-token cost (vllm-cpu-tiny's measured
    steps: the same few ms whatever the batch at 344 tokens) are fit with every coefficient
    >= 0, and the profile's step then never shortens with the batch or the context; data the
    model fits with positive coefficients is fit as freely."""
    from engine.costs import least_squares, nonnegative_least_squares

    steps = [
        (1, 120, 1.547), (2, 120, 1.583), (4, 120, 1.834), (8, 120, 2.049), (16, 120, 2.545),
        (1, 344, 1.491), (2, 344, 1.751), (4, 344, 1.927), (8, 344, 1.901), (16, 344, 1.856),
    ]  # fmt: skip
    rows = [(b * L, b, L, 1.0) for b, L, _ in steps]
    free = least_squares(rows, [ms for *_, ms in steps])
    assert free[0] < 0  # (what a free fit makes of them)
    kept = nonnegative_least_squares(rows, [ms for *_, ms in steps])
    assert all(x >= 0 for x in kept)
    lines = [orjson.dumps({"batch": b, "mean_context": L, "step_ms": ms}) for b, L, ms in steps]
    lines += [
        orjson.dumps({"new_tokens": n, "prefill_ms": 4.5 + 0.009 * n}) for n in (32, 128, 400)
    ]
    profile, _ = fit_profile(read_samples(lines), "tiny", default_profile(), prefill_degree=1)
    for b in (1, 8, 64):
        steps_ms = [profile.decode_step_ms(b, L) for L in (100, 1_000, 100_000)]
        assert steps_ms == sorted(steps_ms) and steps_ms[0] > 0
    clean = _rows(0.0)
    profile, _ = fit_profile(read_samples(clean), "gpu-x", default_profile())
    assert profile.decode_a == pytest.approx(2e-5, rel=1e-6)


def test_a_profile_whose_decode_step_shortens_is_refused() -> None:
    from dataclasses import replace

    from kvgate.cost_model import ProfileError

    with pytest.raises(ProfileError, match="decode coefficient a"):
        replace(default_profile(), name="bad", decode_a=-2.3e-4)
    with pytest.raises(ProfileError, match="decode coefficient d"):
        replace(default_profile(), name="bad", decode_d=float("nan"))
    tiny = load_profile("vllm-cpu-tiny")
    assert min(tiny.decode_a, tiny.decode_b, tiny.decode_c, tiny.decode_d) >= 0
