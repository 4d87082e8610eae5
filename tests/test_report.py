"""``agentkv report``: a real run's ledger written by the Session, read back, and drawn as a PNG of its data."""

import copy
import json
import struct

import pytest

from agentkv import Backend, Session
from agentkv.cli import main
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.report import life_of, read_ledger
from agentkv.state import InProcessStore

TOOLS8 = TOOLS[:8]


def conversation(fresh):
    """A conversation through the embedded pair that warms and escalates; its Session."""
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    agent = ScriptedAgent(result_rows=1)
    msgs = agent.opening()
    with Session(fast, slow, discovery=fresh["discovery"], session_id=fresh["session_id"],
                 state=InProcessStore(cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"])) as s:
        for _ in range(14):
            s.completion(messages=copy.deepcopy(msgs), tools=TOOLS8, max_tokens=2)
            s.drain_warms(30)
            if s.last_route.role == "slow" and s.ledger[-2].backend == "slow":
                break
            msgs = msgs + agent.next_turn()
    return s


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_the_report_draws_a_real_runs_ledger(fresh, tmp_path, capsys):
    """Session.write_ledger then ``agentkv report``: the PNG is written, and the data it draws is the run's own (its
    turns, routes, warm, escalation, cached tokens, and the lines: fast's window, where routing leaves fast, 60%)."""
    s = conversation(fresh)
    ledger = s.write_ledger(tmp_path / "turns.jsonl")
    out = tmp_path / "life.png"
    assert main(["report", str(ledger), "--out", str(out)]) == 0
    assert png_size(out) == (1200, 550)
    header, rows = read_ledger(ledger)
    assert rows == s.ledger
    life = life_of(header, rows)
    assert (life.fast_window, life.leave_fast_at, life.warm_at) == (2048, 2048 - 256, int(2048 * 0.6))
    assert life.warm_turns == [e.turn for e in s.ledger if e.warm == "fire"] != []
    escalated = next(e for e in s.ledger if e.backend == "slow")
    assert life.escalation_turn == escalated.turn and life.cached_tokens[escalated.turn - 1] == escalated.cached_tokens
    assert all(t > life.leave_fast_at for t, b in zip(life.input_tokens, life.backends) if b == "slow")
    printed = capsys.readouterr().out
    assert f"escalation at {escalated.turn}" in printed and str(out) in printed
    text = ledger.read_text()
    assert "content" not in text and "messages" not in text  # sizes and routes only


def test_a_file_that_is_no_ledger_is_refused_naming_what_is_wrong(tmp_path, capsys):
    """Not a ledger, a bad line: exit code 2 and a message naming the file and the line; nothing drawn."""
    bad = tmp_path / "other.jsonl"
    bad.write_text(json.dumps({"rows": []}) + "\n")
    assert main(["report", str(bad), "--out", str(tmp_path / "x.png")]) == 2
    assert "not an agentkv ledger" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
    quiet = tmp_path / "events.jsonl"
    quiet.write_text(json.dumps({"event": "route"}) + "\n")
    assert main(["report", str(quiet), "--out", str(tmp_path / "x.png")]) == 2
    assert "turn_answered events" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"agentkv_ledger": 1, "fast_window": 10, "output_floor": 1,
                                  "warm_threshold": 0.6}) + "\n{oops\n")
    assert main(["report", str(broken), "--out", str(tmp_path / "y.png")]) == 2
    assert "line 2: not JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="line 2: not a ledger row"):
        broken.write_text(json.dumps({"agentkv_ledger": 1}) + "\n" + json.dumps({"turn": 1}) + "\n")
        read_ledger(broken)


def test_the_report_reads_a_json_lines_event_log_of_many_conversations(fresh, tmp_path, capsys):
    """A JSON-lines log of agentkv's events (what structlog's JSONRenderer writes), two conversations in it: the
    report draws the longer (or the one ``--session`` names), from its turn_answered and route events alone."""
    from agentkv.testing import capture_events

    with capture_events() as events:
        s = conversation(fresh)
        fresh["session_id"] = "another-conversation"
        short = conversation_of(fresh, turns=2)
    log = tmp_path / "agentkv.log"
    log.write_text("not json: a console line\n" + "".join(json.dumps(e, default=str) + "\n" for e in events))
    out = tmp_path / "from-log.png"
    assert main(["report", str(log), "--out", str(out)]) == 0 and png_size(out)[0] == 1200
    header, rows = read_ledger(log)
    assert rows == s.ledger and header["session"] == s.session_id
    assert (header["fast_window"], header["output_floor"]) == (2048, 256)
    header, rows = read_ledger(log, session=short.session_id)
    assert rows == short.ledger
    with pytest.raises(ValueError, match="no turns of session"):
        read_ledger(log, session="nobody")
    capsys.readouterr()


def conversation_of(fresh, turns):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    agent = ScriptedAgent(result_rows=1)
    msgs = agent.opening()
    with Session(fast, discovery=fresh["discovery"], session_id=fresh["session_id"]) as s:
        for _ in range(turns):
            s.completion(messages=copy.deepcopy(msgs), tools=TOOLS8, max_tokens=2)
            msgs = msgs + agent.next_turn()
    return s
