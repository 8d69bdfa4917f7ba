"""The routing matrix: knee calibration, verdicts, and a CI slice in which e2 must not lose."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from bench.matrix import (
    MatrixSpec,
    NoKnee,
    calibrate,
    compare,
    draw_heatmaps,
    format_verdict,
    heatmap_grid,
    load_knees,
    pool,
    profile_digest,
    run_matrix,
    verdict,
)

SLICE_FIELDS: dict = dict(
    workloads=("tool_use", "zipf_doc_qa"),
    policies=("e2", "round_robin", "least_load"),
    fleets=(4,),
    kinds=("homo", "hetero"),
    rates=(1.0, 2.0),
    min_requests=300,
    max_requests=300,
    # sized by count (CI time): 300 requests span 5-40 s on 4 engines, several times a
    # request's time in the system for these short-answer workloads
    min_window_s=0.0,
)
SLICE = MatrixSpec(**SLICE_FIELDS)


@pytest.fixture(scope="module")
def slice_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("matrix") / "slice.json"
    doc = run_matrix(SLICE, jobs=1, out=out, log=lambda line: None)
    assert orjson.loads(out.read_bytes())["verdict"] == doc["verdict"]  # saved as it ran
    return doc


def test_e2_never_worse_than_round_robin_or_least_load(slice_doc: dict) -> None:
    """The CI slice of issue 17: in every cell e2's attainment is at least the best of round
    robin and least load minus 1 point, and its p99 TTFT of all requests (a refused one never
    answered) at most 1.1x theirs."""
    assert len(slice_doc["combos"]) == 4
    for entry in slice_doc["combos"]:
        for cell in entry["cells"]:
            name = f"{entry['workload']}/{entry['kind']}/x{cell['rate']:g}"
            cmp = compare(cell)
            assert cmp is not None
            assert cmp["attainment"] >= -0.01, (name, cmp)
            assert cmp["ttft_p99_all_ok"], (name, cmp)


def test_knees_are_reused_only_on_the_same_engines(slice_doc: dict, tmp_path: Path) -> None:
    """A knee is where round robin drops below 90% on those engines: another scheduler or
    slowness has its own, so a rerun does not borrow them."""
    path = tmp_path / "slice.json"
    path.write_bytes(orjson.dumps(slice_doc))
    knees = load_knees(path, SLICE)
    assert set(knees) == {("tool_use", 4, k) for k in ("homo", "hetero")} | {
        ("zipf_doc_qa", 4, k) for k in ("homo", "hetero")
    }
    for change in (
        {"scheduler": "fcfs"},
        {"slow_factor": 3.0},
        {"min_window_s": 20.0},
        {"hetero_profile": "mistral-7b-a6000@x3"},
    ):
        with pytest.raises(ValueError, match=next(iter(change))):
            load_knees(path, MatrixSpec(**{**SLICE_FIELDS, **change}))
    # a document from before cells had a minimum window was sized by count alone
    legacy = dict(
        slice_doc, spec={k: v for k, v in slice_doc["spec"].items() if k != "min_window_s"}
    )
    path.write_bytes(orjson.dumps(legacy))
    assert set(load_knees(path, SLICE)) == set(knees)
    with pytest.raises(ValueError, match="min_window_s"):
        load_knees(path, MatrixSpec(**{**SLICE_FIELDS, "min_window_s": 20.0}))
    # the profile's name stays when its curve changes: a document records what it said, and
    # one without the record ran on Preble's released curve (before the eighteenth session)
    assert slice_doc["profile_digest"] == profile_digest(SLICE.profile)
    for digest in (None, "0123456789abcdef"):
        other = {k: v for k, v in slice_doc.items() if k != "profile_digest"}
        if digest is not None:
            other["profile_digest"] = digest
        path.write_bytes(orjson.dumps(other))
        with pytest.raises(ValueError, match="another version of profile"):
            load_knees(path, SLICE)
    assert profile_digest("mistral-7b-a6000@x2") != profile_digest("mistral-7b-a6000")


def test_knees_from_another_draw_keep_the_rate_not_the_baseline_run(
    slice_doc: dict, tmp_path: Path
) -> None:
    """Another draw of the same workloads (``workload_seed``) takes the knees as rates; the
    knee's round robin run was of other requests, so the x1 cell runs round robin again, on
    this draw's requests."""
    path = tmp_path / "slice.json"
    path.write_bytes(orjson.dumps(slice_doc))
    same = load_knees(path, SLICE)
    assert all("baseline_run" in knee for knee in same.values())
    spec = replace(
        SLICE,
        workloads=("tool_use",),
        kinds=("homo",),
        rates=(1.0,),
        policies=("round_robin",),
        workload_seed=1,
    )
    other = load_knees(path, spec)
    assert set(other) == set(same)
    for combo, knee in other.items():
        assert "baseline_run" not in knee
        assert knee["scale"] == same[combo]["scale"]
    doc = run_matrix(spec, jobs=1, knees=other, log=lambda line: None)
    (run,) = doc["combos"][0]["cells"][0]["runs"]
    old = same[("tool_use", 4, "homo")]["baseline_run"]
    assert run["scale"] == old["scale"]
    assert run != old  # other requests, run afresh


def test_records_hold_every_runs_requests_the_baseline_included(
    slice_doc: dict, tmp_path: Path
) -> None:
    """``--records DIR``: every run of a narrowed matrix writes its requests, round robin at
    x1 too (the knee's run, reused otherwise, is run again for them), and the figures are the
    ones the matrix runs without records (the predictions read do not move a decision)."""
    path = tmp_path / "slice.json"
    path.write_bytes(orjson.dumps(slice_doc))
    spec = replace(SLICE, workloads=("zipf_doc_qa",), kinds=("homo",), rates=(1.0,))
    doc = run_matrix(
        spec,
        jobs=1,
        knees=load_knees(path, spec),
        records_dir=tmp_path / "r",
        log=lambda line: None,
    )
    runs = doc["combos"][0]["cells"][0]["runs"]
    (before,) = [
        e for e in slice_doc["combos"] if (e["workload"], e["kind"]) == ("zipf_doc_qa", "homo")
    ]
    (cell,) = [c for c in before["cells"] if c["rate"] == 1.0]

    def figures(run: dict) -> dict:
        return {k: v for k, v in run.items() if k != "wall_s"}

    assert [figures(r) for r in runs] == [figures(r) for r in cell["runs"]]
    files = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert files == [
        "zipf_doc_qa-4-homo-x1-e2-s0.jsonl",
        "zipf_doc_qa-4-homo-x1-least_load-s0.jsonl",
        "zipf_doc_qa-4-homo-x1-round_robin-s0.jsonl",
    ]
    for run in runs:
        name = f"zipf_doc_qa-4-homo-x1-{run['policy']}-s0.jsonl"
        lines = [orjson.loads(x) for x in (tmp_path / "r" / name).read_bytes().splitlines()]
        assert len(lines) == run["requests"]
        assert sum(x["slo_met"] for x in lines) / len(lines) == pytest.approx(
            run["attainment"], abs=1e-4
        )
        assert all(x["predicted_ttft_ms"] is not None for x in lines if x["status"] == 200)


def test_knee_brackets_round_robins_target_attainment(slice_doc: dict) -> None:
    """At the knee round robin is below the target; at the largest probed rate under it, not."""
    for entry in slice_doc["combos"]:
        knee = entry["knee"]
        target = knee["target_attainment"]
        below = [p for p in knee["probes"] if p["scale"] < knee["scale"]]
        assert knee["baseline_run"]["attainment"] < target
        assert below and max(below, key=lambda p: p["scale"])["attainment"] >= target
        ratio = knee["scale"] / max(p["scale"] for p in below)
        assert ratio <= 1 + SLICE.knee_tolerance + 1e-9
        # the x1 cell's round robin run is the knee's probe, not a second run
        x1 = next(c for c in entry["cells"] if c["rate"] == 1.0)
        rr = next(r for r in x1["runs"] if r["policy"] == "round_robin")
        assert rr == knee["baseline_run"]


def test_calibration_is_deterministic() -> None:
    spec = MatrixSpec(
        workloads=("tool_use",), policies=("round_robin",), fleets=(4,), kinds=("homo",),
        rates=(1.0,), min_requests=200, max_requests=200, min_window_s=0.0,
    )  # fmt: skip
    a = calibrate(spec, "tool_use", 4, "homo")
    b = calibrate(spec, "tool_use", 4, "homo")
    assert a["scale"] == b["scale"] and a["probes"] == b["probes"]


def test_a_combo_without_a_knee_is_skipped_with_the_reason() -> None:
    """A workload whose load does not grow with its rate (closed-loop conversations, cells too
    small) has no knee: calibration says so, and the matrix skips the combo instead of failing
    the whole run."""
    spec = MatrixSpec(
        workloads=("tool_use",), policies=("round_robin", "e2"), fleets=(4,), kinds=("homo",),
        rates=(1.0,), min_requests=100, max_requests=100, min_window_s=0.0,
        knee_attainment=0.01,  # round robin never falls below 1%
    )  # fmt: skip
    with pytest.raises(NoKnee, match="load does not grow with the rate"):
        calibrate(spec, "tool_use", 4, "homo")
    lines: list[str] = []
    doc = run_matrix(spec, jobs=1, log=lines.append)
    assert doc["combos"] == [] and doc["verdict"]["cells"] == 0
    assert [s["combo"] for s in doc["skipped"]] == ["tool_use/4/homo"]
    assert any(line.startswith("matrix: skipped tool_use/4/homo") for line in lines)


def test_cells_span_a_minimum_window() -> None:
    """A cell has enough requests for ``min_window_s`` of arrivals at its rate (within the caps):
    sized by count alone, a fast cell is a burst shorter than a request's time in the system."""
    spec = MatrixSpec(
        requests_per_engine=10, min_requests=100, max_requests=200, min_window_s=20.0,
        max_window_requests=1000,
    )  # fmt: skip
    assert spec.requests_for(4) == 100  # (rate unknown: by count)
    assert spec.requests_for(4, rps=2.0) == 100  # 100 requests span 50 s already
    assert spec.requests_for(4, rps=30.0) == 600
    assert spec.requests_for(4, rps=100.0) == 1000  # the window's cap
    assert spec.requests_for(4, mean_input_tokens=1e6, rps=100.0) == 100  # the token cap wins
    assert replace(spec, min_window_s=0.0).requests_for(4, rps=100.0) == 100
    with pytest.raises(ValueError, match="min_window_s"):
        MatrixSpec(min_window_s=-1.0)
    # the knee's cells and probes have as many requests as their rate needs
    small = MatrixSpec(
        workloads=("tool_use",), policies=("round_robin",), fleets=(4,), kinds=("homo",),
        rates=(1.0,), min_requests=100, max_requests=100, min_window_s=8.0,
    )  # fmt: skip
    knee = calibrate(small, "tool_use", 4, "homo")
    assert knee["requests"] > 100
    assert knee["requests"] / knee["rps"] >= 0.9 * small.min_window_s
    assert knee["baseline_run"]["requests"] == knee["requests"]


def _run(
    policy: str,
    att: float,
    p99: float,
    hit: float = 0.5,
    load: float = 1.0,
    seed=0,
    p99_all: float | str | None = "served",
):
    return {
        "policy": policy, "seed": seed, "scale": 1.0, "attainment": att, "ttft_p50_ms": p99 / 4,
        "ttft_p99_ms": p99, "ttft_p99_all_ms": p99 if p99_all == "served" else p99_all,
        "hit_rate": hit, "load_max_mean": load,
    }  # fmt: skip


def _doc(cells: list[dict]) -> list[dict]:
    return [{"workload": "w", "fleet": 4, "kind": "homo", "knee": {}, "cells": cells}]


def test_verdict_judges_cells_geomeans_spread_and_seeds() -> None:
    good = {
        "rate": 1.0,
        "runs": [
            _run("e2", 0.95, 1000.0),
            _run("cache_aware", 0.95, 1500.0),
            _run("round_robin", 0.80, 3000.0),
        ],
    }
    v = verdict(_doc([good]))
    assert v["p99_all_vs_cache_aware"] == {
        "subject_only": 0, "other_only": 0, "both": 1, "both_geomean_gain": 1.5, "neither": 0,
    }  # fmt: skip
    assert v["passed"] == {
        "every_cell": True,
        "geomean_vs_cache_aware": True,  # 1000 / 1500
        "geomean_vs_round_robin": True,  # 3000 / 1000 where round robin is below 90%
        "load_spread": True,
        "seeds": True,
    }
    bad = {
        "rate": 2.0,
        "runs": [
            _run("e2", 0.90, 1200.0, load=1.5, hit=0.5),
            _run("e2", 0.95, 1200.0, load=1.5, seed=1),
            _run("cache_aware", 0.92, 1000.0),
            _run("cache_aware", 0.92, 1000.0, seed=1),
        ],
    }
    v = verdict(_doc([bad]))
    assert not v["passed"]["every_cell"] and len(v["cells_failed"]) == 1
    assert "-2.0 pt" in v["cells_failed"][0]
    assert not v["passed"]["geomean_vs_cache_aware"]
    assert not v["passed"]["load_spread"]  # 1.5 with no hit-rate gain
    assert not v["passed"]["seeds"]  # 0.90 vs 0.95
    assert "FAIL" in format_verdict(v)


def test_a_load_spread_is_paid_by_hits_judged_on_the_p99_of_all_requests() -> None:
    """More hits than round robin at no less attainment pay for a spread; the latency side is
    the p99 of all requests (round robin's engines refuse the slowest first tokens, so the p99
    of what they serve is low): both infinite, hits and attainment decide."""

    def cell(e2_all: float | None, rr_all: float | None) -> dict:
        return {
            "rate": 1.0,
            "runs": [
                _run("e2", 0.86, 6000.0, hit=0.20, load=1.5, p99_all=e2_all),
                _run("round_robin", 0.68, 5000.0, hit=0.06, load=1.1, p99_all=rr_all),
            ],
        }

    v = verdict(_doc([cell(None, None)]))  # neither answers 99%
    assert v["passed"]["load_spread"]
    assert len(v["load_spread_failed_by_served_p99"]) == 1  # served: 6000 > 5000
    v = verdict(_doc([cell(None, 5000.0)]))  # round robin answers 99%, e2 does not
    assert not v["passed"]["load_spread"]
    v = verdict(_doc([cell(4000.0, 5000.0)]))
    assert v["passed"]["load_spread"]


def test_heatmap_grid_and_drawing(slice_doc: dict, tmp_path: Path) -> None:
    rows, cols, grid = heatmap_grid(slice_doc, "attainment")
    assert rows == ["tool_use (hetero)", "tool_use (homo)", "zipf_doc_qa (hetero)",
                    "zipf_doc_qa (homo)"]  # fmt: skip
    assert cols == ["4 eng x1", "4 eng x2"]
    assert all(v is not None for row in grid for v in row)
    paths = draw_heatmaps(slice_doc, tmp_path, stem="m")
    pytest.importorskip("matplotlib")
    # the p99 of all requests is a ratio only where e2 and another policy both answer 99%: a
    # metric without a value in any cell gets no map
    _, _, all_grid = heatmap_grid(slice_doc, "ttft_p99_all_ratio")
    with_all = any(v is not None for row in all_grid for v in row)
    assert {p.name for p in paths} == {
        "m_attainment.png",
        "m_ttft_p99_ratio.png",
        "m_hit_rate.png",
        "m_load_max_mean.png",
    } | ({"m_ttft_p99_all_ratio.png"} if with_all else set())
    assert all(p.stat().st_size > 1000 for p in paths)
    # and it is drawn once a cell has one
    answered = orjson.loads(orjson.dumps(slice_doc))  # (the fixture is shared: a copy)
    for run in answered["combos"][0]["cells"][0]["runs"]:
        run["ttft_p99_all_ms"] = run["ttft_p99_ms"]
    assert "m_ttft_p99_all_ratio.png" in {p.name for p in draw_heatmaps(answered, tmp_path, "m")}


def test_cells_are_judged_on_the_p99_of_all_requests() -> None:
    """A policy that refuses over 1% of a cell's requests has no p99 of all requests: e2 serving
    everything with a higher p99 of served requests passes against it, e2 refusing over 1%
    where another answers 99% fails, and where nobody answers 99% attainment alone judges."""
    serves_all = {
        "rate": 1.0,
        "runs": [
            _run("e2", 0.99, 1900.0),
            _run("round_robin", 0.85, 1000.0, p99_all=None),
        ],
    }
    v = verdict(_doc([serves_all]))
    assert v["passed"]["every_cell"], v
    assert len(v["cells_p99_of_served_over_1_1x"]) == 1  # still on the record
    # the geomean against round robin reads the p99 of served requests (1000 / 1900); the
    # tally of the p99 of all requests says who answered 99%
    assert v["geomean_p99_gain_vs_round_robin_below_90"] == pytest.approx(1000 / 1900, abs=1e-4)
    assert v["p99_all_vs_round_robin_below_90"] == {
        "subject_only": 1, "other_only": 0, "both": 0, "both_geomean_gain": None, "neither": 0,
    }  # fmt: skip
    assert "only e2 answers 99% in 1 cells, only round_robin in 0" in format_verdict(v)
    refuses = {
        "rate": 1.0,
        "runs": [_run("e2", 0.99, 900.0, p99_all=None), _run("round_robin", 0.99, 1000.0)],
    }
    v = verdict(_doc([refuses]))
    assert not v["passed"]["every_cell"]
    assert "none (over 1% unanswered) vs round_robin's" in v["cells_failed"][0]
    nobody = {
        "rate": 2.0,
        "runs": [
            _run("e2", 0.80, 3000.0, p99_all=None),
            _run("round_robin", 0.79, 1000.0, p99_all=None),
        ],
    }
    v = verdict(_doc([nobody]))
    assert v["passed"]["every_cell"] and v["cells_without_p99"] == ["w/4/homo/x2"]
    nobody["runs"][0]["attainment"] = 0.75
    v = verdict(_doc([nobody]))
    assert v["cells_failed"] == [
        "w/4/homo/x2: attainment -4.0 pt vs round_robin, p99 of all requests none for any policy"
    ]


def test_engines_can_report_as_vllm_behind_the_bridge() -> None:
    """``reporting="bridge"``: the cells' engines send no request events (the simulator's
    ``LinkConfig.request_events``), as a plain vLLM behind the bridge; the gateway reports each
    answer's first token. Anything else is refused."""
    assert MatrixSpec().sim_config(4, "homo", 0).link.request_events
    link = MatrixSpec(reporting="bridge").sim_config(4, "homo", 0).link
    assert not link.request_events and link.gateway_ttft
    with pytest.raises(ValueError, match="reporting"):
        MatrixSpec(reporting="vllm")


def test_a_fleet_of_two_generations_runs_the_second_profile_on_every_second_engine(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``hetero_profile`` (``--hetero-profile``): a hetero cell's every second engine runs
    that profile (slowed by ``slow_factor``) and announces it; homogeneous cells keep
    ``profile``. One whose tokenizer differs is refused before anything runs."""
    from kvgate.cli import main

    gen2 = "results/profiles/mistral-7b-a6000-24gb-b32.json"
    spec = MatrixSpec(hetero_profile=gen2)
    cfg = spec.sim_config(4, "hetero", 0)
    assert cfg.profiles == ("mistral-7b-a6000", gen2) * 2
    assert [p.block_tokens for p in cfg.engine_profiles()] == [16, 32] * 2
    assert cfg.engine_profiles()[1].prefill_ms(1000) == pytest.approx(
        2 * cfg.engine_profiles()[0].prefill_ms(1000)
    )
    assert spec.sim_config(4, "homo", 0).profiles is None
    assert MatrixSpec().sim_config(4, "hetero", 0).profiles is None
    argv = ["bench", "matrix", "--quick", "--hetero-profile", "vllm-cpu-small",
            "--out", str(tmp_path / "m.json")]  # fmt: skip
    assert main(argv) == 2
    assert "bytes_per_token" in capsys.readouterr().err


def test_a_slow_broker_delays_every_engine_event_to_the_router() -> None:
    """``link_delay_s`` / ``link_jitter_s`` (``--link-delay``, ``--link-jitter``) are the
    simulator's event link for every cell: by default its few milliseconds; a negative delay
    is refused."""
    link = MatrixSpec().sim_config(4, "homo", 3).link
    assert (link.link_delay_s, link.link_jitter_s, link.seed) == (0.002, 0.001, 3)
    link = MatrixSpec(link_delay_s=0.5, link_jitter_s=0.25).sim_config(4, "hetero", 0).link
    assert (link.link_delay_s, link.link_jitter_s) == (0.5, 0.25)
    with pytest.raises(ValueError, match="link_delay_s"):
        MatrixSpec(link_delay_s=-0.1)


def _matrix_doc(cells: list[dict], workload_seed: int) -> dict:
    combos = [{"workload": "w", "fleet": 4, "kind": "homo", "knee": {}, "cells": cells}]
    return {"kind": "kvgate-matrix", "spec": {"workload_seed": workload_seed}, "combos": combos}


def test_pooled_draws_judge_each_cells_mean() -> None:
    """Over draws of the workloads a cell is judged on each policy's mean: e2 2 points behind
    on one draw and 1 ahead on the other is half a point behind, which passes; a p99 of all
    requests missing on any draw is missing in the pool; a cell one draw lacks is left out."""

    def cell(rate: float, e2_att: float, ca_att: float, p99_all: float | None = 900.0) -> dict:
        return {
            "rate": rate,
            "scale": rate,
            "runs": [
                {
                    **_run("e2", e2_att, 1000.0, p99_all=p99_all),
                    "requests": 600,
                    "reasons": {"x": 1},
                },
                {**_run("cache_aware", ca_att, 1000.0, p99_all=p99_all), "requests": 600},
            ],
        }

    first = _matrix_doc([cell(1.0, 0.80, 0.82), cell(2.0, 0.70, 0.70)], 0)
    second = _matrix_doc([cell(1.0, 0.83, 0.82, p99_all=None)], 1)
    assert not verdict(first["combos"])["passed"]["every_cell"]  # -2 points on one draw
    doc = pool([first, second])
    assert doc["spec"]["workload_seed"] == [0, 1]
    [entry] = doc["combos"]
    [only] = entry["cells"]  # x2 is on the first draw only
    e2 = next(r for r in only["runs"] if r["policy"] == "e2")
    assert e2["attainment"] == pytest.approx(0.815)
    assert e2["ttft_p99_ms"] == pytest.approx(1000.0)
    assert e2["ttft_p99_all_ms"] is None  # over 1% unanswered on the second draw
    assert e2["requests"] == 1200 and e2["reasons"] == {"x": 2}
    # -0.5 points on the mean, and no p99 of all requests for either: attainment judges
    assert doc["verdict"]["passed"]["every_cell"]
    assert doc["verdict"]["cells_without_p99"] == ["w/4/homo/x1"]
    with pytest.raises(ValueError):
        pool([])
    with pytest.raises(ValueError):
        pool([{"kind": "other"}])


def test_seed_spread_is_judged_without_other_policies() -> None:
    """A rerun of e2 alone over several router seeds still measures its spread."""
    alone = {"rate": 1.0, "runs": [_run("e2", 0.90, 1000.0), _run("e2", 0.93, 1000.0, seed=1)]}
    v = verdict(_doc([alone]))
    assert v["cells"] == 0 and v["seeded_cells"] == 1
    assert not v["passed"]["seeds"]


def test_pool_command_prints_verdicts_and_refuses_bad_documents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvgate bench matrix --pool``: the pooled verdicts printed and saved; a file that is not
    a matrix document is refused with a message and exit status 2, nothing written."""
    from kvgate.cli import main

    good = {
        "rate": 1.0,
        "scale": 1.0,
        "runs": [_run("e2", 0.9, 900.0), _run("cache_aware", 0.9, 1000.0)],
    }
    a, b, bad = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "bad.json"
    a.write_bytes(orjson.dumps(_matrix_doc([good], 0)))
    b.write_bytes(orjson.dumps(_matrix_doc([good], 1)))
    out = tmp_path / "pooled.json"
    assert main(["bench", "matrix", "--pool", str(a), str(b), "--out", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "pooled 2 documents (workload seeds [0, 1])" in printed
    assert "verdict for e2 over 1 cells" in printed
    assert orjson.loads(out.read_bytes())["pooled"] == 2
    bad.write_text("{not json")
    out.unlink()
    assert main(["bench", "matrix", "--pool", str(a), str(bad), "--out", str(out)]) == 2
    assert "kvgate bench matrix --pool:" in capsys.readouterr().err
    assert not out.exists()


def test_docs_state_the_max_window_requests_default() -> None:
    """docs/bench.md said 5,000 while the code, --help and README said 2,500."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "bench.md").read_text()
    stated = f"`--max-window-requests`, {MatrixSpec().max_window_requests:,})"
    assert stated in " ".join(text.split())


def test_matrix_without_matplotlib_says_tables_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heatmaps were silently skipped: now one line says why, as bench report's does."""
    import sys

    from kvgate.cli import main

    cell = {"rate": 1.0, "scale": 1.0, "runs": [_run("e2", 0.9, 900.0)]}
    a = tmp_path / "a.json"
    a.write_bytes(orjson.dumps(_matrix_doc([cell], 0)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import raises ImportError)
    assert main(["bench", "matrix", "--pool", str(a), "--out", str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("matplotlib is not installed; tables only") == 1
    assert not list(tmp_path.glob("*.png"))


def test_matrix_refuses_a_bad_policy_before_any_calibration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """e2[foo=1] was refused only after the knees were calibrated (minutes of simulation)."""
    from kvgate.cli import build_parser

    for spec, words in (("e2[foo=1]", "unknown option(s) foo"), ("nope", "unknown policy")):
        argv = ["bench", "matrix", "--quick", "--policies", f"round_robin,{spec}"]
        with pytest.raises(SystemExit) as exit_:
            build_parser(argv).parse_args(argv)  # nothing has run yet
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --policies" in err and words in err
