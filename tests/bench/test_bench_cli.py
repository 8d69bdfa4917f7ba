"""``kvgate bench ...`` end to end on tiny inputs (sim -> JSON -> report; workloads; errors)."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from kvgate import native
from kvgate.cli import build_parser, main


def test_sim_then_report_from_the_command_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim.json"
    rc = main(
        [
            "bench", "sim", "--trace", "tool_use", "--rate", "6", "--duration", "10",
            "--engines", "3", "--policies", "e2,round_robin,e2-rebalance",
            "--schedulers", "slo", "--rate-scale", "1,2", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert [(r["policy"], r["rate_scale"]) for r in doc["runs"]] == [
        ("e2", 1.0),
        ("round_robin", 1.0),
        ("e2-rebalance", 1.0),
        ("e2", 2.0),
        ("round_robin", 2.0),
        ("e2-rebalance", 2.0),
    ]
    assert "| tool_use | e2 | slo | 1 |" in capsys.readouterr().out
    report = tmp_path / "rep.md"
    assert main(["bench", "report", "--inputs", str(out), "--out", str(report)]) == 0
    text = report.read_text()
    assert "e2-rebalance" in text and "rep_tool_use_policies_slo_ttft.png" in text
    assert (tmp_path / "rep_tool_use_policies_slo_ttft.png").exists()


def test_sim_writes_every_request_record_without_changing_the_run(tmp_path: Path) -> None:
    """``--records DIR``: one JSON line per request per run, with the router's predicted TTFT
    on the engine it chose (reading the decision's candidates must not move a decision)."""
    args = ["bench", "sim", "--trace", "tool_use", "--rate", "6", "--duration", "10",
            "--engines", "3", "--policies", "e2,e2[rebalance=false]",
            "--rate-scale", "1,2"]  # fmt: skip
    recs = ["--records", str(tmp_path / "recs")]
    assert main([*args, "--out", str(tmp_path / "plain.json")]) == 0
    assert main([*args, *recs, "--out", str(tmp_path / "r.json")]) == 0
    plain = orjson.loads((tmp_path / "plain.json").read_bytes())["runs"]
    with_records = orjson.loads((tmp_path / "r.json").read_bytes())["runs"]
    assert [r["summary"] for r in with_records] == [r["summary"] for r in plain]
    names = sorted(p.name for p in (tmp_path / "recs").iterdir())
    assert names == [
        "e2-slo-x1.jsonl", "e2-slo-x2.jsonl",
        "e2[rebalance-false]-slo-x1.jsonl", "e2[rebalance-false]-slo-x2.jsonl",
    ]  # fmt: skip
    for run in with_records:
        lines = [orjson.loads(x) for x in Path(run["records"]).read_bytes().splitlines()]
        assert len(lines) == run["summary"]["requests"]
        served = [x for x in lines if x["status"] == 200]
        assert served and all(x["engine"] and x["reason"] for x in served)
        assert all(x["predicted_ttft_ms"] > 0 for x in served)
        met = sum(x["slo_met"] for x in lines) / len(lines)
        assert met == pytest.approx(run["summary"]["slo_attainment"], abs=1e-4)


def test_sim_replays_a_qwen_bailian_format_trace(tmp_path: Path, caplog) -> None:
    """A hash-id trace of 16-token blocks and seconds (Qwen-Bailian's format) replays as it is:
    read as Mooncake's 512-token blocks and milliseconds, every line was skipped and the run
    crashed on an empty workload."""
    caplog.set_level(logging.WARNING)  # (whatever level an earlier test left the root at)
    trace = tmp_path / "qwen_trace.jsonl"
    rows = []
    for i in range(60):  # 3 system prompts of 4 blocks, a question of 2-3 blocks each
        n_in = 64 + 20 + i % 17
        ids = [100 * (i % 3) + b for b in range(4)] + [1000 + 10 * i + b for b in range(3)]
        rows.append({"chat_id": i, "parent_chat_id": -1, "timestamp": round(0.37 * i, 3),
                     "input_length": n_in, "output_length": 8, "type": "text", "turn": 1,
                     "hash_ids": ids[: -(-n_in // 16)]})  # fmt: skip
    trace.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    out = tmp_path / "q.json"
    rc = main(["bench", "sim", "--trace", str(trace), "--engines", "2", "--policies",
               "e2,round_robin", "--out", str(out)])  # fmt: skip
    assert rc == 0
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [r["summary"]["requests"] for r in runs] == [60, 60]
    # the arrivals are seconds (22 s of trace, not 22 ms), and the shared system prompts hit
    e2 = runs[0]["summary"]
    assert 2 < e2["offered_rps"] < 4 and e2["prefix_hit_rate"] > 0.3
    assert "read as 16-token hash blocks" in caplog.text


def test_sim_runs_a_mixed_fleet_from_the_command_line(tmp_path: Path) -> None:
    """``--speeds 1:2,3:2``: two engines at the profile's speed, two taking 3x as long (and
    announcing the profile, so the router must find them out); e2 sends the slow ones less."""
    out = tmp_path / "mixed.json"
    rc = main(["bench", "sim", "--trace", "tool_use", "--rate", "6", "--duration", "30",
               "--speeds", "1:2,3:2", "--policies", "e2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert doc["world"]["speeds"] == [1.0, 1.0, 3.0, 3.0]
    per = doc["runs"][0]["summary"]["per_engine_requests"]
    assert len(per) == 4 and per["e00"] + per["e01"] > 1.5 * (per["e02"] + per["e03"])


def test_sim_runs_two_gpu_generations_from_the_command_line(tmp_path: Path, capsys) -> None:
    """``--engine-profiles``: two engines of the default profile, two of a what-if card with
    a quarter of the memory in 32-token blocks, twice as slow (``--speeds``); each announces
    its own profile, and the counts must agree with the other fleet flags."""
    out = tmp_path / "gen.json"
    gen2 = "results/profiles/mistral-7b-a6000-24gb-b32.json"
    rc = main(["bench", "sim", "--trace", "tool_use", "--rate", "6", "--duration", "20",
               "--engine-profiles", f"mistral-7b-a6000:2,{gen2}:2", "--speeds", "1:2,2:2",
               "--policies", "e2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert doc["world"]["profiles"] == ["mistral-7b-a6000"] * 2 + [gen2] * 2
    assert doc["runs"][0]["summary"]["slo_attainment"] > 0.9
    rc = main(["bench", "sim", "--trace", "tool_use", "--speeds", "1:3",
               "--engine-profiles", f"mistral-7b-a6000:2,{gen2}:2", "--out", str(out)])  # fmt: skip
    assert rc == 2 and "--speeds 3, --engine-profiles 4" in capsys.readouterr().err
    for bad in ("mistral-7b-a6000", "mistral-7b-a6000:0", ":2", "a:x"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "sim", "--trace", "tool_use", "--engine-profiles", bad])
        assert exit_.value.code == 2 and "--engine-profiles" in capsys.readouterr().err
    rc = main(["bench", "sim", "--trace", "tool_use", "--engine-profiles", "no-such:2",
               "--out", str(out)])  # fmt: skip
    assert rc == 2 and "no-such" in capsys.readouterr().err


def test_sim_scales_a_fleet_out_from_the_command_line(tmp_path: Path) -> None:
    """``--join 2@10``: the last two of four engines join 10 s into the run; e2 sends them
    nothing before and a share of the requests after."""
    out = tmp_path / "join.json"
    rc = main(["bench", "sim", "--trace", "tool_use", "--rate", "6", "--duration", "30",
               "--engines", "4", "--join", "2@10", "--policies", "e2",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert doc["world"]["joins"] == [0.0, 0.0, 10.0, 10.0]
    per = doc["runs"][0]["summary"]["per_engine_requests"]
    assert per["e02"] + per["e03"] > 0.15 * sum(per.values())


def test_sim_runs_engine_outages_from_the_command_line(tmp_path: Path) -> None:
    """``--outage 1@5:15``: engine 1 of four is down from 5 s to 15 s into the run; its
    requests in flight fail, the rest are served, and it serves again once back."""
    out = tmp_path / "outage.json"
    rc = main(["bench", "sim", "--trace", "tool_use", "--rate", "6", "--duration", "30",
               "--engines", "4", "--outage", "1@5:15", "--policies", "e2",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert doc["world"]["outages"] == [{"engine": 1, "down_at": 5.0, "up_at": 15.0}]
    run = doc["runs"][0]
    assert run["sim"]["outages"] == 1
    status = run["summary"]["status"]
    assert set(status) <= {"200", "502"} and status["200"] > 0.9 * run["summary"]["requests"]
    assert run["summary"]["per_engine_requests"]["e01"] > 0


def test_bad_input_is_an_error_code_not_a_crash(tmp_path: Path, capsys) -> None:
    assert main(["bench", "report", "--inputs", str(tmp_path / "missing.json")]) == 2
    rc = main(["bench", "sim", "--trace", "nope", "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "unknown workload" in capsys.readouterr().err
    for bad in ("2:x", "0:4", "fast:2", ""):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "sim", "--trace", "tool_use", "--speeds", bad])
        assert exit_.value.code == 2 and "--speeds" in capsys.readouterr().err
    for bad in ("2", "0@5", "2@0", "x@5", "2@inf"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "sim", "--trace", "tool_use", "--join", bad])
        assert exit_.value.code == 2 and "--join" in capsys.readouterr().err
    for bad in ("1", "x@5", "1@5:4", "1@-1", "1@5:x"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "sim", "--trace", "tool_use", "--outage", bad])
        assert exit_.value.code == 2 and "--outage" in capsys.readouterr().err
    rc = main(["bench", "sim", "--trace", "tool_use", "--engines", "2", "--outage", "2@5",
               "--out", str(tmp_path / "x.json")])  # fmt: skip
    assert rc == 2 and "engine indexes run from 0 to 1" in capsys.readouterr().err
    rc = main(["bench", "sim", "--trace", "tool_use", "--engines", "2", "--join", "2@5",
               "--out", str(tmp_path / "x.json")])  # fmt: skip
    assert rc == 2 and "must start" in capsys.readouterr().err
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"not json\n")
    rc = main(["bench", "sim", "--trace", str(junk), "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "no requests in" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # refused while the arguments are parsed
        main(["bench", "sim", "--trace", "tool_use", "--duration", "2", "--policies",
              "e2[bogus=1]", "--out", str(tmp_path / "x.json")])  # fmt: skip
    assert exit_.value.code == 2 and "bogus" in capsys.readouterr().err
    # knees of the matrix found on other engines (the default slo scheduler) are refused
    knees = tmp_path / "knees.json"
    knees.write_bytes(orjson.dumps({"kind": "kvgate-matrix", "spec": {}, "combos": []}))
    rc = main(["bench", "matrix", "--quick", "--scheduler", "fcfs", "--knees-from", str(knees),
               "--out", str(tmp_path / "m.json"), "--no-plots"])  # fmt: skip
    assert rc == 2 and "scheduler 'slo', not 'fcfs'" in capsys.readouterr().err
    # ... and so are knees found on other hardware, and a profile that does not exist
    out = str(tmp_path / "m.json")
    rc = main(["bench", "matrix", "--quick", "--profile", "mistral-7b-a6000@x0.2",
               "--knees-from", str(knees), "--out", out, "--no-plots"])  # fmt: skip
    assert rc == 2 and "profile 'mistral-7b-a6000', not 'mistral-7b-a6000@x0.2'" in (
        capsys.readouterr().err
    )
    rc = main(["bench", "matrix", "--quick", "--profile", "no-such-gpu", "--out", out,
               "--no-plots"])  # fmt: skip
    assert rc == 2 and "no profile" in capsys.readouterr().err
    rc = main(["bench", "matrix", "--quick", "--link-delay", "-1", "--out", out,
               "--no-plots"])  # fmt: skip
    assert rc == 2 and "link_delay_s" in capsys.readouterr().err


def test_workloads_verb(capsys) -> None:
    assert main(["bench", "workloads"]) == 0
    listing = capsys.readouterr().out
    assert "mooncake" in listing and "qwen_mix" in listing
    assert main(["bench", "workloads", "programming", "--rate", "2", "--duration", "30"]) == 0
    shape = orjson.loads(capsys.readouterr().out)
    assert 30 <= shape["requests"] <= 100


def test_cprofile_breakdown_names_the_packages(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    rc = main(
        [
            "bench", "sim", "--trace", "programming", "--rate", "4", "--duration", "5",
            "--engines", "2", "--policies", "e2", "--cprofile", str(tmp_path / "prof"),
            "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    (run,) = orjson.loads(out.read_bytes())["runs"]
    packages = run["profile"]["own_s_by_package"]
    # (a mypyc-compiled router is invisible to cProfile: its time shows in its callers)
    expected = {"bench", "engine"} | (set() if native.active() else {"router"})
    assert expected <= set(packages)
    assert run["profile"]["top_functions"]
    assert list((tmp_path / "prof").glob("*.prof"))


def _mooncake_lines(n: int) -> bytes:
    return b"".join(
        b'{"timestamp": %d, "input_length": 1024, "output_length": 8, "hash_ids": [%d, 2]}\n'
        % (i * 100, i % 7)
        for i in range(n)
    )


@pytest.mark.parametrize("verb", ["sim", "replay", "workloads"])
@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_gzipped_trace_is_an_error_naming_the_file(
    tmp_path: Path, capsys, verb: str, damage: str
) -> None:
    """gzip notices a cut or garbled file only while reading it (EOFError, zlib.error)."""
    import gzip

    whole = gzip.compress(_mooncake_lines(3000))
    if damage == "truncated":
        data = whole[: len(whole) // 2]
    else:  # the deflate stream's first bytes garbled: zlib.error
        data = whole[:10] + b"\xff" * 8 + whole[18:]
    trace = tmp_path / f"{damage}.jsonl.gz"
    trace.write_bytes(data)
    argv = {
        "sim": ["bench", "sim", "--trace", str(trace), "--out", str(tmp_path / "x.json")],
        "replay": ["bench", "replay", "--url", "http://127.0.0.1:18499", "--trace", str(trace),
                   "--out", str(tmp_path / "r")],
        "workloads": ["bench", "workloads", str(trace)],
    }[verb]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvgate bench {verb}: {trace}: truncated or corrupt gzip file")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("flag", "bad"), [("--start", "-1"), ("--duration", "-3"), ("--duration", "0"),
                      ("--rate", "-3"), ("--rate", "0"), ("--rate", "nan")],
)  # fmt: skip
def test_workload_window_and_rate_must_make_sense(flag: str, bad: str, capsys) -> None:
    for verb in ("sim", "replay", "workloads"):
        argv = ["bench", verb, "--trace", "mooncake", flag, bad]
        argv += ["--url", "http://127.0.0.1:18499"] if verb == "replay" else []
        with pytest.raises(SystemExit) as exit_:
            build_parser(argv).parse_args(argv)  # refused before any work
        assert exit_.value.code == 2
        assert f"argument {flag}: want a number" in capsys.readouterr().err


def test_a_window_left_empty_is_the_no_requests_error(tmp_path: Path, capsys) -> None:
    """Not a KeyError from a summary of nothing: the error an empty trace gets."""
    small = tmp_path / "small.jsonl"
    small.write_bytes(_mooncake_lines(20))
    for workload in ("mooncake", str(small)):
        rc = main(["bench", "sim", "--trace", workload, "--start", "999999",
                   "--out", str(tmp_path / "x.json")])  # fmt: skip
        assert rc == 2
        err = capsys.readouterr().err.strip()
        assert err == f"kvgate bench sim: no requests in {workload} within start 999999 s"


@pytest.mark.parametrize("bad", ["-5", "0"])
def test_max_requests_below_one_is_refused(bad: str, capsys) -> None:
    """-5 sliced as requests[:-5] meant 'all but the last 5'; 0 left nothing to run."""
    for argv in (
        ["bench", "sim", "--trace", "mooncake", "--max-requests", bad],
        ["bench", "workloads", "mooncake", "--max-requests", bad],
        ["bench", "matrix", "--max-requests", bad],
    ):
        with pytest.raises(SystemExit) as exit_:
            build_parser(argv).parse_args(argv)
        assert exit_.value.code == 2
        assert "argument --max-requests: want an integer >= 1" in capsys.readouterr().err


def test_limit_refuses_a_negative_count() -> None:
    from bench.workloads import build_workload, limit

    reqs = build_workload("tool_use")
    assert limit(reqs, 3) == reqs[:3] and limit(reqs, None) == reqs
    with pytest.raises(ValueError, match="max_requests"):
        limit(reqs, -5)


@pytest.mark.parametrize(
    ("spec", "words"),
    [("e2[rebalance=maybe]", "option rebalance wants a boolean"),
     ("e2[rebalance_ratio=abc]", "option rebalance_ratio wants a number, got 'abc'")],
)  # fmt: skip
def test_sim_policy_option_of_the_wrong_type_is_refused_at_parsing(
    spec: str, words: str, capsys
) -> None:
    """'maybe' ran as a truthy string; 'abc' crashed with a TypeError in the middle of a run."""
    argv = ["bench", "sim", "--trace", "tool_use", "--policies", f"round_robin,{spec}"]
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv).parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --policies" in err and words in err


def test_messages_name_the_scheduler_the_flag_and_the_file(tmp_path: Path, capsys) -> None:
    from engine.scheduler import make_policy

    with pytest.raises(ValueError, match="unknown scheduler 'bogus'"):
        make_policy("bogus")  # (it said "unknown policy", as if a router policy)
    for argv, words in (
        (["bench", "sim", "--schedulers", "slo,bogus"],
         "argument --schedulers: unknown scheduler 'bogus' (known: slo, fcfs, preble)"),
        (["bench", "matrix", "--seeds", "x"], "argument --seeds: want comma-separated integers"),
        (["bench", "matrix", "--fleets", "4,x"], "argument --fleets: want comma-separated"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            build_parser(argv).parse_args(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    for argv in (
        ["bench", "report", "--inputs", str(corrupt), "--out", str(tmp_path / "r.md")],
        ["bench", "matrix", "--quick", "--knees-from", str(corrupt), "--out",
         str(tmp_path / "m.json")],
    ):  # fmt: skip
        assert main(argv) == 2
        assert f"{corrupt}: not a JSON document" in capsys.readouterr().err


def test_engines_disagreeing_with_speeds_or_roles_is_refused(tmp_path: Path, capsys) -> None:
    """--engines 4 --speeds 1:2,2:1 ran 3 engines without a word."""
    out = str(tmp_path / "x.json")
    for sized, n in (("--speeds", "1:2,2:1"), ("--roles", "prefill:1,decode:1")):
        rc = main(["bench", "sim", "--trace", "tool_use", "--engines", "4", sized, n,
                   "--out", out])  # fmt: skip
        assert rc == 2
        err = capsys.readouterr().err
        assert f"--engines 4, but {sized} names" in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["demo", "--engines", "0"], "--engines"), (["demo", "--engines", "-3"], "--engines"),
     (["demo", "--duration", "-2"], "--duration"), (["demo", "--rate", "0"], "--rate"),
     (["demo", "--max-requests", "0"], "--max-requests"),
     (["bench", "sim", "--engines", "0"], "--engines")],
)  # fmt: skip
def test_demo_and_sim_counts_and_durations_must_be_positive(
    argv: list[str], flag: str, capsys
) -> None:
    """demo --engines 0 ran one engine and --duration -2 one second, silently."""
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv).parse_args(argv)
    assert exit_.value.code == 2 and f"argument {flag}: want" in capsys.readouterr().err
