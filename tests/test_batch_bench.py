"""Tests of the batched-throughput benchmark (eval/batch.py, ``python -m eval batch``).

Offline and CPU-only: the tiny random Llama with the word-level tokenizer of test_api.py saved to a temporary
folder, and a random head."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import spy_generate
from test_api import make_llama, make_tokenizer, save_target_and_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eval/ is not installed: import it from the checkout

import eval.batch as batch  # noqa: E402
from eval.__main__ import main as eval_main  # noqa: E402
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.config import TreeConfig  # noqa: E402

torch.set_num_threads(1)

ROW_KEYS = {"method", "divergence", "threshold", "batch_size", "tokens_per_s", "tau", "peak_mem_gb", "prompts",
            "max_new_tokens", "device", "dtype", "tree", "vs_ar"}
META_KEYS = {"date", "command", "git_commit", "torch", "transformers", "settings"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_target_and_head(tmp_path_factory.mktemp("batch_models"), head_seed=5)


def args(folders, out, *extra, methods="ar,eagle2", sizes="1,2"):
    return ["batch", "--target", str(folders / "target"), "--head", str(folders / "head"), "--device", "cpu",
            "--dtype", "float32", "--threads", "1", "--limit", "3", "--max-new-tokens", "6", "--total-tokens", "6",
            "--depth", "3", "--tree-top-k", "2", "--batch-sizes", sizes, "--methods", methods, "--output", str(out),
            *extra]


@pytest.fixture
def list_calls(monkeypatch):
    """Counts generate calls given a list of prompts (the benchmark's warm-up and timed calls)."""
    return spy_generate(monkeypatch, lambda prompt: isinstance(prompt, list) and prompt and isinstance(prompt[0], list),
                        lambda kw: kw.get("batch_size"))


def test_rows_have_the_schema(folders, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert eval_main(args(folders, out, "--fsd", "kl:1", "--hf-limit", "1", methods="ar,eagle2,fsd,hf")) == 0
    data = json.loads(out.read_text())
    assert META_KEYS <= set(data["meta"]) and data["meta"]["command"].startswith("python -m eval batch")
    rows = data["rows"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [
        (m, b) for b in (1, 2) for m in ("ar", "eagle2", "fsd", "hf_generate")]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["tokens_per_s"] > 0 and r["max_new_tokens"] == 6 and r["dtype"] == "float32"
        assert r["peak_mem_gb"] is None  # CPU
        assert r["vs_ar"] == pytest.approx(r["tokens_per_s"] / next(
            a["tokens_per_s"] for a in rows if a["method"] == "ar" and a["batch_size"] == r["batch_size"]), abs=1e-3)
        if r["method"] == "hf_generate":
            assert r["tau"] is None and r["tree"] is None
            assert r["rounds"] is None and r["prefill_s"] is None and r["other_s"] is None
            assert r["prompts"] == max(r["batch_size"], 1)  # --hf-limit 1: max(batch size, 1) prompts
        else:
            assert r["prompts"] == 3 and r["tau"] >= 1.0
            # where the wall time went: every prompt prefilled (in groups), rounds timed, the rest >= 0
            assert 1 <= r["prefills"] <= 3 and r["rounds"] >= 1 and r["prefill_s"] > 0 and r["round_s"] > 0
            assert r["ms_per_round"] * r["rounds"] / 1e3 == pytest.approx(r["round_s"], abs=1e-3)
            assert r["other_s"] == pytest.approx(r["wall_s"] - r["prefill_s"] - r["round_s"], abs=2e-3)
            assert r["other_s"] > -2e-3
            # the tree the batch drafted with; plain decoding drafts none
            assert r["tree"] == (None if r["method"] == "ar" else {"total_tokens": 6, "depth": 3, "top_k": 2})
            assert r["new_tokens"] <= 3 * 6
            # batch 1: the MT-bench prompts alone (here all 3 prompts): the same tau, their own decoding times
            if r["batch_size"] == 1:
                assert r["mt_bench_prompts"] == 3 and r["mt_bench_tau"] == r["tau"]
                assert r["mt_bench_tokens_per_s"] >= r["tokens_per_s"] * 0.999  # no time between the prompts
            else:
                assert r["mt_bench_prompts"] is r["mt_bench_tokens_per_s"] is r["mt_bench_tau"] is None
    fsd = next(r for r in rows if r["method"] == "fsd")
    assert (fsd["divergence"], fsd["threshold"]) == ("kl", 1.0)
    assert next(r for r in rows if r["method"] == "ar")["vs_ar"] == 1.0
    table = capsys.readouterr().out
    assert "hf_generate" in table and "vs AR" in table


def test_prompt_set_is_mt_bench_then_the_rest_of_spec_bench():
    from eval.tasks import load_chat_benchmark, load_mt_bench

    questions = load_chat_benchmark()
    assert len(questions) == 480 and len({q.question_id for q in questions}) == 480
    assert [q.question_id for q in questions[:80]] == [q.question_id for q in load_mt_bench()]
    assert all(q.subtask != "mt_bench" for q in questions[80:])
    assert [q.question_id for q in load_chat_benchmark(limit=85)] == [q.question_id for q in questions[:85]]
    assert batch.load_prompts(2) == [q.turns[0] for q in questions[:2]]


def test_split_new_tokens_stops_at_eos():
    generated = torch.tensor([[5, 6, 2, 2, 2], [7, 8, 9, 10, 11], [2, 0, 0, 0, 0], [4, 9, 4, 2, 0]])
    assert batch.split_new_tokens(generated, {2, 9}) == [([5, 6], 3), ([7, 8], 3), ([], 1), ([4], 2)]
    assert batch.split_new_tokens(generated[1:2], {2}) == [([7, 8, 9, 10, 11], 5)]
    ids, mask = batch.left_pad([[3, 4, 5], [6]], pad_id=2)
    assert ids.tolist() == [[3, 4, 5], [2, 2, 6]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_hf_batch_counts_like_unpadded_generate_and_our_decoder():
    """Left-padded batched greedy generate gives each prompt the tokens of that prompt alone, unpadded (fp32),
    and counts new tokens as DecodeStats.new_tokens does: our AR decoder gets the same ids and counts."""
    model = make_llama(seed=0)
    prompts = [[3, 17, 40], [5, 6, 7, 8, 9, 10, 11], [60, 61, 62, 63, 64], [90]]
    n = 12
    alone = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    # An EOS that ends one prompt's text midway, and maybe others: a token the first one generates at step 4.
    eos = alone[0][4]
    model.generation_config.eos_token_id = eos
    gen = SpeculativeGenerator(model, make_tokenizer())
    assert eos in gen.eos_ids
    expected = batch.split_new_tokens(torch.tensor(alone), gen.eos_ids)
    assert expected[0] == (alone[0][: alone[0].index(eos)], alone[0].index(eos) + 1)
    pad = batch.pad_token_id(gen.tokenizer, gen.eos_ids)
    got = batch.hf_generate_batch(model, prompts, n, pad_id=pad, eos_ids=gen.eos_ids)
    assert got == expected
    # A pad token that is not an EOS (filling the finished row after its EOS, and the prompts' left side).
    assert pad in gen.eos_ids and batch.hf_generate_batch(model, prompts, n, pad_id=0, eos_ids=gen.eos_ids) == expected
    ours = gen.generate(prompts, n, autoregressive=True, batch_size=4)
    assert [(r.token_ids, r.stats.new_tokens) for r in ours] == expected


def test_resume_skips_done_rows(folders, tmp_path, list_calls, capsys):
    out = tmp_path / "b.json"
    assert eval_main(args(folders, out, methods="ar")) == 0
    assert list_calls == [1, 1, 1, 2, 2, 2]  # per row: warm-up batch, 2-token pass, timed call
    first = json.loads(out.read_text())
    list_calls.clear()
    assert eval_main(args(folders, out, "--resume", methods="ar,eagle2")) == 0
    assert list_calls == [1, 1, 1, 2, 2, 2]  # only the eagle2 rows
    data = json.loads(out.read_text())
    assert [(r["method"], r["batch_size"]) for r in data["rows"]] == [("ar", 1), ("ar", 2), ("eagle2", 1),
                                                                      ("eagle2", 2)]
    assert data["rows"][:2] == first["rows"]  # kept as measured (vs_ar included)
    assert data["meta"]["earlier_runs"][0]["command"] == first["meta"]["command"]
    list_calls.clear()
    assert eval_main(args(folders, out, "--resume", methods="ar,eagle2")) == 0
    assert list_calls == []  # everything done
    # Other settings: refused, the file untouched.
    before = out.read_text()
    assert eval_main(args(folders, out, "--resume", "--max-new-tokens", "5", methods="ar")) == 2
    assert "other settings" in capsys.readouterr().err and out.read_text() == before
    # Without --resume: a fresh file.
    assert eval_main(args(folders, out, methods="ar", sizes="1")) == 0
    assert len(json.loads(out.read_text())["rows"]) == 1


def test_a_killed_run_leaves_valid_json(folders, tmp_path, monkeypatch):
    out = tmp_path / "b.json"
    real = batch.measure_ours
    seen = []

    def killed_at_the_third(*a, **kw):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(batch, "measure_ours", killed_at_the_third)
    assert eval_main(args(folders, out)) == 130
    data = json.loads(out.read_text())
    assert [(r["method"], r["batch_size"]) for r in data["rows"]] == [("ar", 1), ("eagle2", 1)]
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # no temporary file left
    monkeypatch.setattr(batch, "measure_ours", real)
    assert eval_main(args(folders, out, "--resume")) == 0
    assert len(json.loads(out.read_text())["rows"]) == 4


def test_prefill_waste_counts_each_prefill_as_a_graph_session_runs_it(tmp_path, capsys):
    """eval/prefill_waste.py decodes prompts of given lengths with the real Scheduler and Session on a tiny
    model and counts rows x padded length per prefill; the token limits it draws run from 50 to 256."""
    from eval import prefill_waste

    lengths = [5, 700, 130, 40, 12, 600]
    prefills = prefill_waste.measure(lengths, [3, 1, 4, 2, 2, 5], batch_size=4)
    assert sorted(n for p in prefills for n in p.lengths) == sorted(lengths)
    first = prefills[0]  # the first fill: the 4 shortest prompts in one 4-row forward
    assert (first.rows, sorted(first.lengths), first.padded) == (4, [5, 12, 40, 130], 256)
    waste = prefill_waste.summarize(4, prefills)
    assert waste.real_tokens == sum(lengths)
    assert waste.padded_tokens == sum(p.rows * p.padded for p in prefills) >= waste.real_tokens
    assert waste.graphs == len({(p.rows, p.padded) for p in prefills})
    limits = prefill_waste.token_limits(480)
    assert min(limits) >= 50 and max(limits) == 256 and 190 < sum(limits) / 480 < 230
    (tmp_path / "lengths.json").write_text(json.dumps(lengths))
    prefill_waste.main(["--lengths", str(tmp_path / "lengths.json"), "--batch-sizes", "1,4",
                        "--out", str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert [r["batch_size"] for r in out["rows"]] == [1, 4] and out["rows"][0]["prefills"] == 6
    assert "batch prefills" in capsys.readouterr().out


def test_session_clock_times_prefills_and_rounds_only_while_running(folders):
    """Session.clock: nothing is recorded until started; then one prefill span per prompt started and one
    round span per launched round (on the CPU rounds run one at a time, so a prompt decoded alone takes its
    target forwards less the prefill in rounds); stop ends the timing and totals stay readable."""
    gen = SpeculativeGenerator.load(str(folders / "target"), head=str(folders / "head"), device="cpu",
                                    dtype="float32", tree=TreeConfig(total_tokens=6, depth=3, top_k=2))
    session = gen.session()
    gen.generate([[5, 6, 7]], 5, chat=False)
    assert session.clock.totals() == {"prefills": 0, "prefill_s": 0.0, "rounds": 0, "round_s": 0.0}
    session.clock.start()
    result = gen.generate([[5, 6, 7]], 5, chat=False)[0]
    session.clock.stop()
    spent = session.clock.totals()
    assert spent["prefills"] == 1 and spent["rounds"] == result.stats.target_forwards - 1 >= 1
    assert spent["prefill_s"] > 0 and spent["round_s"] > 0
    gen.generate([[5, 6, 7]], 5, chat=False)  # stopped: nothing added
    assert session.clock.totals() == spent
