"""The consumer's pure core: verdicts on entries, gaps, and which snapshots end a gap."""

from __future__ import annotations

import pytest

from broker.base import parse_id
from broker.events import Envelope, RequestStarted, Snapshot
from broker.tracker import Cursor, State, Verdict


def envs(epoch: str, first: int, n: int) -> list[Envelope]:
    return [Envelope("e", epoch, first + i, 1.0, RequestStarted("r")) for i in range(n)]


def active(epoch: str, next_seq: int) -> Cursor:
    c = Cursor("e")
    c.load(Snapshot("e", epoch, next_seq - 1, "10-0", ()))
    return c


def test_expected_seq_applies_and_advances() -> None:
    c = active("a", 5)
    batch = envs("a", 5, 3)
    assert c.classify(batch) == (Verdict.APPLY, 0)
    c.advance("11-0", batch[-1])
    assert (c.position, c.next_seq) == ("11-0", 8)


def test_overlapping_resend_applies_only_the_new_tail() -> None:
    assert active("a", 5).classify(envs("a", 3, 4)) == (Verdict.APPLY, 2)


def test_fully_seen_entry_is_a_duplicate() -> None:
    assert active("a", 5).classify(envs("a", 1, 4))[0] is Verdict.DUPLICATE


def test_seq_jump_is_a_gap() -> None:
    assert active("a", 5).classify(envs("a", 6, 1))[0] is Verdict.GAP


def test_new_epoch_from_zero_restarts_and_old_epoch_becomes_stale() -> None:
    c = active("a", 5)
    batch = envs("b", 0, 2)
    assert c.classify(batch)[0] is Verdict.NEW_EPOCH
    c.advance("12-0", batch[-1])
    assert c.epoch == "b" and c.next_seq == 2
    assert c.classify(envs("a", 5, 1))[0] is Verdict.STALE


def test_new_epoch_not_from_zero_is_a_gap() -> None:
    assert active("a", 5).classify(envs("b", 3, 1))[0] is Verdict.GAP


def test_fresh_cursor_accepts_only_an_epoch_start() -> None:
    c = Cursor("e")
    c.start_without_snapshot()
    assert c.classify(envs("a", 0, 1))[0] is Verdict.NEW_EPOCH
    assert c.classify(envs("a", 7, 1))[0] is Verdict.GAP  # stream was trimmed


def test_gap_is_covered_only_by_a_snapshot_reaching_past_it() -> None:
    c = active("a", 5)
    head = envs("a", 9, 1)[0]
    gap = c.open_gap("20-0", head)
    assert c.state is State.WAITING and gap.seq == 8
    assert not c.covered_by(Snapshot("e", "a", 7, "15-0", ()))
    assert c.covered_by(Snapshot("e", "a", 8, "15-0", ()))
    # another epoch's snapshot counts only if taken after the entry that showed the gap
    assert not c.covered_by(Snapshot("e", "z", 0, "19-5", ()))
    assert c.covered_by(Snapshot("e", "z", 0, "20-0", ()))
    c.load(Snapshot("e", "a", 8, "15-0", ()))
    assert c.state is State.ACTIVE and c.position == "15-0" and c.next_seq == 9


def test_a_jump_to_a_seq_the_engine_never_reaches_is_ended_by_a_later_snapshot() -> None:
    """An entry of the current epoch at seq 2**63: the gap asked for a snapshot of seq >= 2**63
    - 1, which the engine never publishes, so its stream (heartbeats too) was never read again.
    A snapshot the engine took after that entry ends it; an earlier one still does not."""
    c = active("a", 5)
    assert c.classify(envs("a", 2**63, 1))[0] is Verdict.GAP
    c.open_gap("20-0", envs("a", 2**63, 1)[0])
    assert not c.covered_by(Snapshot("e", "a", 7, "19-0", ()))
    assert c.covered_by(Snapshot("e", "a", 7, "21-0", ()))
    c.load(Snapshot("e", "a", 7, "21-0", ()))
    assert c.classify(envs("a", 8, 1)) == (Verdict.APPLY, 0)


def test_retired_epoch_snapshot_is_never_loaded() -> None:
    c = active("a", 5)
    c.advance("12-0", envs("b", 0, 1)[0])
    c.open_gap("13-0", envs("b", 5, 1)[0])
    assert not c.covered_by(Snapshot("e", "a", 100, "99-0", ()))


def test_stream_ids_are_parsed_only_as_redis_accepts_them() -> None:
    """int() takes "1_000", " 1", "+1", other scripts' digits and any size; Redis refuses them,
    and one such position (from a snapshot) made every multi-stream XREAD fail."""
    assert parse_id("0-0") == (0, 0)
    assert parse_id("17") == (17, 0)
    top = "18446744073709551615"
    assert parse_id(f"{top}-{top}") == (2**64 - 1, 2**64 - 1)
    for bad in (
        "18446744073709551616-0",
        "0-18446744073709551616",
        "1_000-0",
        " 1-0",
        "+1-0",
        "1-",
        "-1",
        "",
        "\u0661-0",  # ARABIC-INDIC DIGIT ONE
        "0" * 21,
        "1-2-3",
    ):
        with pytest.raises(ValueError):
            parse_id(bad)


def test_a_retired_epoch_publishing_while_the_current_is_silent_is_taken_back() -> None:
    """A forged epoch at seq 0 retired the engine's real one, whose every entry was then stale
    for good. Once the real epoch has published for ``reclaim_after_ms`` of stream time past
    the forged epoch's last entry, it is taken back and resynced from its snapshot."""
    c = Cursor("e", reclaim_after_ms=5000)
    c.load(Snapshot("e", "real", 4, "1000-0", ()))
    forged = envs("forged", 0, 1)
    assert c.classify(forged, "2000-0")[0] is Verdict.NEW_EPOCH
    c.advance("2000-0", forged[-1])
    assert c.classify(envs("real", 5, 1), "4000-0")[0] is Verdict.STALE
    assert c.classify(envs("real", 9, 1), "6999-0")[0] is Verdict.STALE
    head = envs("real", 10, 1)
    assert c.classify(head, "7000-0")[0] is Verdict.RECLAIM
    gap = c.reclaim("7000-0", head[0])
    assert (gap.epoch, gap.seq, c.state) == ("real", 9, State.WAITING)
    assert not c.covered_by(Snapshot("e", "forged", 0, "7500-0", ()))  # (the forged one's)
    assert c.covered_by(Snapshot("e", "real", 10, "7001-0", ()))
    c.load(Snapshot("e", "real", 10, "7001-0", ()))
    assert c.epoch == "real" and "forged" in c.retired
    assert c.classify(envs("real", 11, 1), "7002-0") == (Verdict.APPLY, 0)
    assert c.classify(envs("forged", 1, 1), "7003-0")[0] is Verdict.STALE


def test_a_real_restart_keeps_its_epoch_while_a_zombie_of_the_old_one_publishes() -> None:
    """An engine restarted for real writes (heartbeats at least) far more often than the
    reclaim window: its old process's late entries stay stale however long they go on."""
    c = Cursor("e", reclaim_after_ms=5000)
    c.load(Snapshot("e", "old", 4, "1000-0", ()))
    new = envs("new", 0, 1)
    assert c.classify(new, "2000-0")[0] is Verdict.NEW_EPOCH
    c.advance("2000-0", new[-1])
    for t in range(1, 30):  # 29 s: the new epoch every second, the zombie in between
        assert c.classify(envs("old", 4 + t, 1), f"{2000 + 1000 * t - 500}-0")[0] is Verdict.STALE
        batch = envs("new", t, 1)
        assert c.classify(batch, f"{2000 + 1000 * t}-0") == (Verdict.APPLY, 0)
        c.advance(f"{2000 + 1000 * t}-0", batch[-1])
    assert c.epoch == "new"
