"""End-to-end tests of the head trainer (``python -m training run``), offline on the CPU.

Each target is a tiny random model saved to a temporary folder with an offline tokenizer that has a chat
template: for Llama the word-level one of tests/test_api.py ("w5 w17 ..."); for Qwen2, whose model type makes
transformers load a Qwen2Tokenizer whatever the folder declares, a byte-level BPE one (one token per ASCII
byte), as real Qwen2 checkpoints ship. The conversations' assistant turns are the target's own greedy
continuations, so the head has something to learn. Every test drives ``training.__main__.main``, the real
pipeline: data -> self-distillation -> online features -> training -> validation tau -> export.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import inspect
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import training.cli
import training.distill
from training.distill import sample_id
import training.train
from conftest import has_cpu_compiler, tiny_model
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.head import EagleHead, HeadConfig
from fsd_eagle.models import load_head, load_target, save_head
from test_api import make_tokenizer
from training.__main__ import main
from training.data import Conversation, read_conversations, write_conversations

torch.set_num_threads(1)

VOCAB = 128
N_CONVS = 30
ANSWER_TOKENS = 24

# About 4 batches per epoch, 2 distilled conversations of 8 tokens, validation on 2 held-out prompts.
RECIPE = dict(distill=True, distill_count=2, distill_batch=2, distill_new_tokens=8, distill_prompt_tokens=64,
              max_len=96, tokens_per_batch=384, epochs=6, lr=5e-3, warmup_steps=2, val_fraction=0.15,
              val_prompts=2, val_new_tokens=16, checkpoint_every=1000, seed=0)
EPOCHS = RECIPE["epochs"]


# ------------------------------------------------------------------------------------------- fixtures


def word_tokenizer():
    """tests/test_api.py's word-level tokenizer, with a generation prompt (the <s> opening a turn)."""
    tok = make_tokenizer(VOCAB)
    tok.chat_template = ("{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}<s> {% endif %}")
    return tok


def _byte_char(b: int) -> str:
    """The character byte-level BPE uses for byte ``b`` (printable bytes stand for themselves, the others
    are shifted past U+0100 in byte order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def byte_tokenizer():
    """Qwen2-style byte-level BPE without merges: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2 (EOS), then
    one token per ASCII byte 3..127 (id = byte value); a ChatML template."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({_byte_char(b): b for b in range(3, VOCAB)})
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<|endoftext|>", eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", extra_special_tokens=["<|im_start|>"], chat_template=template)


TOKENIZERS = {"llama": word_tokenizer, "qwen2": byte_tokenizer}
UNSEEN = {"llama": "w7 w8 w9 w10", "qwen2": "an unseen prompt"}
USER_IDS = {"llama": range(3, VOCAB), "qwen2": [ord(c) for c in "abcdefghijklmnopqrstuvwxyz      "]}


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _conversations(model, tokenizer, user_ids) -> list[Conversation]:
    """N_CONVS random user prompts, each answered by the target's greedy continuation."""
    rng = random.Random(123)
    convs = []
    for i in range(N_CONVS):
        user = tokenizer.decode([rng.choice(user_ids) for _ in range(8)]).strip()
        ids = torch.tensor([_ids(tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                                                 tokenize=True, add_generation_prompt=True))])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_TOKENS,
                                 do_sample=False, pad_token_id=0)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        assert answer
        convs.append(Conversation(f"conv-{i}", i, "synthetic", [{"role": "user", "content": user},
                                                              {"role": "assistant", "content": answer}]))
    return convs


class Setup:
    """A saved tiny target (model + tokenizer), its conversation file and a recipe file."""

    def __init__(self, root: Path, arch: str):
        from transformers import AutoTokenizer

        self.root = root
        self.target = root / f"{arch}-target"
        model = tiny_model(arch, vocab_size=VOCAB)
        model.generation_config.eos_token_id = None  # random weights: never stop early
        model.save_pretrained(self.target)
        TOKENIZERS[arch]().save_pretrained(self.target)
        tokenizer = AutoTokenizer.from_pretrained(self.target)  # as the pipeline will load it
        assert len(tokenizer) == VOCAB
        self.convs = _conversations(model, tokenizer, list(USER_IDS[arch]))
        self.data = root / "train.jsonl"
        assert write_conversations(self.convs, self.data) == N_CONVS
        self.recipe = self.write_recipe("recipe.json")

    def write_recipe(self, name: str, **changes) -> Path:
        path = self.root / name
        path.write_text(json.dumps({**RECIPE, **changes}))
        return path

    def argv(self, out: Path, *extra, recipe: Path | None = None, target: Path | None = None,
             data: Path | None = None) -> list[str]:
        return ["run", str(recipe or self.recipe), "--out", str(out), "--target", str(target or self.target),
                "--data", str(data or self.data), "--device", "cpu", "--workers", "1", *map(str, extra)]


_SETUPS: dict[str, Setup] = {}


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    def get(arch: str) -> Setup:
        if arch not in _SETUPS:
            _SETUPS[arch] = Setup(tmp_path_factory.mktemp(arch), arch)
        return _SETUPS[arch]

    yield get
    _SETUPS.clear()


@pytest.fixture(scope="module")
def llama(setups) -> Setup:
    return setups("llama")


def _log(out: Path) -> list[dict]:
    return json.loads((out / "head" / "training_log.json").read_text())


def _progress(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "progress.json").read_text())


# ------------------------------------------------------------------------------------- 1 + 3: smoke


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pipeline_trains_exports_and_decodes_exactly(setups, tmp_path, arch):
    """The whole pipeline on a tiny random target given only its local folder: the loss falls, checkpoint
    and head files are written, and the exported head reloads and decodes exactly as plain decoding."""
    s = setups(arch)
    out = tmp_path / "run"
    assert main(s.argv(out)) == 0

    # files: the distilled cache, a complete checkpoint, the exported head; no temporary leftovers
    for name in ("distilled.jsonl.gz", "checkpoint/head.safetensors", "checkpoint/optimizer.safetensors",
                 "checkpoint/rng.safetensors", "checkpoint/progress.json", "head/config.json",
                 "head/model.safetensors", "head/recipe.json", "head/training_log.json"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoint.tmp").exists() and not (out / "head.tmp").exists()
    with gzip.open(out / "distilled.jsonl.gz", "rt") as f:
        distilled = [json.loads(line) for line in f]
    assert len(distilled) == RECIPE["distill_count"]
    assert all(d["source"] == "distill:synthetic" and d["messages"][-1]["role"] == "assistant" for d in distilled)

    # the log: one entry per epoch, every step counted, metrics averaged over every step, loss falling
    log = _log(out)
    assert [e["epoch"] for e in log] == list(range(1, EPOCHS + 1))
    per_epoch = log[0]["step"]
    assert per_epoch >= 3 and [e["step"] for e in log] == [per_epoch * (k + 1) for k in range(EPOCHS)]
    assert all(e["loss"] > 0 and e["feat"] > 0 and e["ce"] > 0 and "val_tau" in e for e in log)
    assert log[-1]["loss"] < 0.9 * log[0]["loss"], [e["loss"] for e in log]
    assert log[-1]["feat"] < 0.75 * log[0]["feat"], [e["feat"] for e in log]
    assert log[-1]["acc"] > log[0]["acc"]
    progress = _progress(out)
    assert (progress["step"], progress["epoch"], progress["log"]) == (per_epoch * EPOCHS, EPOCHS, log)
    saved_recipe = json.loads((out / "head" / "recipe.json").read_text())
    assert saved_recipe["target"] == str(s.target) and saved_recipe["epochs"] == EPOCHS

    # the exported head is the checkpoint's final head (bf16) and reloads through the public loader
    ck, exported = load_file(out / "checkpoint" / "head.safetensors"), load_file(out / "head" / "model.safetensors")
    assert ck.keys() == exported.keys()
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(ck[k].bfloat16(), exported[k]) for k in ck)
    model, tokenizer = load_target(s.target, torch.device("cpu"), torch.float32)
    head = load_head(out / "head", model.config, torch.device("cpu"), torch.float32)
    gen = SpeculativeGenerator(model, tokenizer, head)
    forwards = tokens = 0
    for prompt in [c.messages[:1] for c in s.convs[:4]] + [UNSEEN[arch]]:
        ref = gen.generate(prompt, 32, autoregressive=True)
        spec = gen.generate(prompt, 32)
        assert spec.token_ids == ref.token_ids and spec.text == ref.text
        forwards, tokens = forwards + spec.stats.target_forwards, tokens + spec.stats.new_tokens
    # the head learned something: an untrained head gets about 1.1 tokens per target forward here
    assert tokens / forwards > 1.3
    # its token ranking (from the answers it trained on) gives a draft vocabulary; decoding stays exact
    vocab = model.config.vocab_size
    assert sorted(head.token_ranking.tolist()) == list(range(vocab))
    gen.set_tree(draft_vocab=vocab // 4)
    for prompt in [c.messages[:1] for c in s.convs[:2]]:
        assert gen.generate(prompt, 32).token_ids == gen.generate(prompt, 32, autoregressive=True).token_ids


# ------------------------------------------------------------------------------------------ 2: resume


def test_resume_continues_from_checkpoint(llama, tmp_path, monkeypatch):
    """epochs=1, then --resume --epochs 2: training continues at the saved step with the saved optimizer
    state, and the distilled cache is reused (no second distillation)."""
    out = tmp_path / "run"
    assert main(llama.argv(out, "--epochs", 1)) == 0
    first = _log(out)
    per_epoch = first[0]["step"]
    assert len(first) == 1 and _progress(out)["step"] == per_epoch
    saved_opt = load_file(out / "checkpoint" / "optimizer.safetensors")
    cache = (out / "distilled.jsonl.gz").read_bytes()

    def no_distill(*args, **kwargs):
        raise AssertionError("the distilled cache should have been reused")

    restored = {}
    real_load = training.train.load_checkpoint

    def spy_load(out_dir, head, opt, rank=0):
        result = real_load(out_dir, head, opt, rank)
        restored.update(result=result, state={i: {k: v.clone() for k, v in st.items()}
                                              for i, st in opt.state_dict()["state"].items()})
        return result

    monkeypatch.setattr(training.distill, "distill", no_distill)
    monkeypatch.setattr(training.train, "load_checkpoint", spy_load)
    assert main(llama.argv(out, "--epochs", 2, "--resume")) == 0

    # the optimizer state after loading equals the saved one, for every parameter (AdamW moments and step)
    assert restored["result"][:2] == (per_epoch, 1)
    state = restored["state"]
    assert len(state) == len({key.split(".")[0] for key in saved_opt}) > 0
    for i, st in state.items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in st.items():
            assert torch.equal(v.float().reshape(saved_opt[f"{i}.{k}"].shape), saved_opt[f"{i}.{k}"]), (i, k)
    assert float(state[0]["step"]) == per_epoch

    log = _log(out)
    assert log[0] == first[0]  # the first epoch's entry comes from the checkpoint, not from a rerun
    assert [e["epoch"] for e in log] == [1, 2] and log[1]["step"] == 2 * per_epoch
    assert _progress(out)["step"] == 2 * per_epoch
    assert (out / "distilled.jsonl.gz").read_bytes() == cache


def test_answers_choose_the_training_set_and_max_steps_caps_training(llama, tmp_path, capsys):
    """--answers original / distilled / both trains on the original answers, the target's regenerated ones
    (distill_count conversations) or their union; max_steps stops training there (the log's last step)."""
    recipe = llama.write_recipe("recipe_steps.json", max_steps=3, epochs=4)
    counts = {}
    for answers in ("original", "distilled", "both"):
        out = tmp_path / answers
        assert main(llama.argv(out, "--answers", answers, recipe=recipe)) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        counts[answers] = next(x["conversations"] for x in lines if "conversations" in x)
        assert _log(out)[-1]["step"] == 3 and _progress(out)["step"] == 3
    assert counts["distilled"] == RECIPE["distill_count"]
    assert counts["both"] == counts["original"] + counts["distilled"] and counts["original"] > counts["distilled"]


def test_max_steps_beyond_the_recipes_epochs_is_said_at_the_start_with_the_epochs_that_reach_it(llama, tmp_path,
                                                                                                 capsys):
    """--max-steps caps a run; it adds no epochs. Asked for more steps than the recipe's epochs make, the run
    says so on stderr before training (with the --epochs that would reach them) and ends with its epochs;
    asked for fewer, it says nothing."""
    import math

    recipe = llama.write_recipe("recipe_short.json", epochs=1, max_steps=1000)
    assert main(llama.argv(tmp_path / "short", recipe=recipe)) == 0
    per_epoch = _progress(tmp_path / "short")["step"]
    assert 0 < per_epoch < 1000 and _log(tmp_path / "short")[-1]["epoch"] == 1
    notes = [x for x in capsys.readouterr().err.splitlines() if "before max_steps" in x]
    assert notes == [f"note: the run ends after its 1 epoch(s) at step {per_epoch:,} ({per_epoch:,} batches an epoch), "
                     f"before max_steps 1,000: give --epochs {math.ceil(1000 / per_epoch)} to reach them"]
    assert main(llama.argv(tmp_path / "capped", "--max-steps", 1, recipe=recipe)) == 0
    assert "before max_steps" not in capsys.readouterr().err and _progress(tmp_path / "capped")["step"] == 1


def test_cudnn_attention_off_keeps_sdpa_off_cudnn_in_every_step_and_resumes_either_way(llama, tmp_path,
                                                                                          monkeypatch):
    """--cudnn-attention off (recipe "cudnn_attention": false, the default): every training step runs with SDPA's
    cuDNN kernel disabled, and the setting is restored after the run; on leaves it enabled. A run resumes under
    the other setting (the same attention, other kernels), and a non-boolean value is refused."""
    import training.train as train_module

    seen, loss = [], train_module.head_loss
    monkeypatch.setattr(train_module, "head_loss",
                        lambda *a, **k: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or loss(*a, **k))
    out = tmp_path / "off"
    assert main(llama.argv(out, "--max-steps", 2, "--stop-after", 0, "--cudnn-attention", "off")) == 0
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
    assert main(llama.argv(out, "--max-steps", 2, "--resume", "--cudnn-attention", "on")) == 0
    assert seen == [False, True] and _progress(out)["step"] == 2
    assert (out / "head" / "model.safetensors").exists()
    assert main(llama.argv(tmp_path / "default", "--max-steps", 1)) == 0
    assert seen == [False, True, False] and torch.backends.cuda.cudnn_sdp_enabled()
    recipe = llama.write_recipe("recipe_cudnn.json", cudnn_attention="no")
    assert main(llama.argv(tmp_path / "bad", recipe=recipe)) == 2
    assert not (tmp_path / "bad").exists()


def test_distill_regenerates_later_turns_after_the_targets_own_answers(llama):
    """distill(turns=N): turn k answers the k-th user message after the target's own earlier answers (the
    original answers are gone), each answer the target's greedy continuation; a conversation with fewer
    user turns ends with its last one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama.target)
    words = [c.messages[0]["content"] for c in llama.convs]
    three = Conversation("three", 0, "synthetic", [
        {"role": "user", "content": words[0]}, {"role": "assistant", "content": "original one"},
        {"role": "user", "content": words[1]}, {"role": "assistant", "content": "original two"},
        {"role": "user", "content": words[2]}])
    one = Conversation("one", 1, "synthetic", [{"role": "user", "content": words[3]},
                                               {"role": "assistant", "content": "original"}])

    def greedy(msgs):
        ids = torch.tensor([_ids(tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True))])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    result = {c.id: c for c in training.distill.distill(model, tokenizer, [three, one], 1, 64, 6, turns=2)}
    assert set(result) == {"three", "one"} and result["three"].source == "distill:synthetic"
    msgs = result["three"].messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert [msgs[0]["content"], msgs[2]["content"]] == words[:2]
    assert msgs[1]["content"] == greedy(msgs[:1]) and msgs[3]["content"] == greedy(msgs[:3])
    assert "original" not in " ".join(m["content"] for m in msgs)
    assert [m["role"] for m in result["one"].messages] == ["user", "assistant"]
    # more turns than the conversation has: its third user message is answered, then it ends
    longer = training.distill.distill(model, tokenizer, [three], 2, 64, 6, turns=5)
    assert len(longer) == 1 and len(longer[0].messages) == 6 and longer[0].messages[:4] == msgs


def test_distill_samples_several_answers_at_a_temperature(llama):
    """distill(temperature > 0, samples=N): N answers per conversation under ids <id>, <id>#1, ...; the
    same seed gives the same answers, another seed other ones; the samples of one prompt differ."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama.target)
    convs = llama.convs[:2]

    def run(seed):
        made = training.distill.distill(model, tokenizer, convs, 4, 64, 8, temperature=1.5, samples=3, seed=seed)
        return {c.id: c.messages[-1]["content"] for c in made}

    first = run(0)
    assert set(first) == {sample_id(c.id, s) for c in convs for s in range(3)}
    assert sample_id(convs[0].id, 0) == convs[0].id and sample_id(convs[0].id, 2) == f"{convs[0].id}#2"
    assert run(0) == first
    assert run(1) != first
    assert len({first[sample_id(convs[0].id, s)] for s in range(3)}) > 1


def test_an_interrupted_distillation_continues_from_its_journal_to_the_same_answers(llama, tmp_path):
    """distill(journal=FOLDER) keeps each batch as it is made: stopped in its third batch (a Ctrl-C) and
    called again, it makes only the batches not kept and gives the answers of one uninterrupted call, sampled
    ones included; a journal line cut short by the interruption is made again; other settings use another
    journal file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama.target)
    convs = llama.convs[:5]
    real, calls, stop_at = model.generate, [], [None]

    def generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    model.generate = generate

    def run(journal=None, seed=0):
        calls.clear()
        made = training.distill.distill(model, tokenizer, convs, 2, 64, 6, turns=2, temperature=1.5, samples=2,
                                        seed=seed, progress=False, journal=journal)
        return {c.id: c.messages for c in made}

    reference, made_alone = run(), len(calls)
    journal = tmp_path / "journal"
    stop_at[0] = 3
    with pytest.raises(KeyboardInterrupt):
        run(journal)
    stop_at[0] = None
    (path,) = journal.iterdir()
    assert len(path.read_text().splitlines()) == 2  # the two batches made before the interruption
    with open(path, "a") as f:
        f.write('{"batch": 4, "answers": ["cut sh')  # a write the interruption cut short
    assert run(journal) == reference and len(calls) == made_alone - 2
    assert run(journal) == reference and len(calls) == 0  # everything kept: nothing made again
    assert run(journal, seed=1) != reference and len(calls) == made_alone  # another seed: its own journal


def test_a_static_cache_distillation_gives_the_dynamic_caches_answers_in_one_shape(llama, tmp_path, capsys,
                                                                                     monkeypatch):
    """distill(cache="static"): generate gets a static cache and every batch the shape [batch, prompt_tokens]
    (the last short batch filled up with copies of a prompt), and the greedy answers are those of the dynamic
    cache (float32); its journal has a name of its own. From the command line, --distill-cache static reaches
    the distillation, a run resumes under the other setting, and a recipe value other than dynamic or static is
    refused in one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama.target)
    convs = llama.convs[:5]  # batches of 2: the last one holds one prompt
    real, calls = model.generate, []

    def generate(*args, **kwargs):
        calls.append((tuple(kwargs["input_ids"].shape), kwargs.get("cache_implementation")))
        return real(*args, **kwargs)

    model.generate = generate

    def run(cache, journal=None):
        calls.clear()
        made = training.distill.distill(model, tokenizer, convs, 2, 64, 6, progress=False, journal=journal,
                                        cache=cache)
        return {c.id: c.messages for c in made}

    dynamic, batches = run("dynamic"), len(calls)
    assert {n for (n, _), _ in calls} == {1, 2} and {c for _, c in calls} == {None}
    assert run("static") == dynamic
    assert calls == [((2, 64), "static")] * batches
    calls.clear()  # fewer prompts than a batch: one batch of them all
    training.distill.distill(model, tokenizer, convs[:1], 4, 64, 6, progress=False, cache="static")
    assert calls == [((1, 64), "static")]
    assert any(m["content"] for msgs in dynamic.values() for m in msgs if m["role"] == "assistant")
    journals = {}
    for cache in ("dynamic", "static"):
        run(cache, tmp_path / cache)
        journals[cache] = sorted(p.name for p in (tmp_path / cache).iterdir())
    assert len(journals["static"]) == 1 and not set(journals["static"]) & set(journals["dynamic"])

    seen, answer = [], training.distill._answer

    def spy(*args, **kwargs):
        seen.append(inspect.signature(answer).bind(*args, **kwargs).arguments.get("cache", "dynamic"))
        return answer(*args, **kwargs)

    monkeypatch.setattr(training.distill, "_answer", spy)
    assert main(llama.argv(tmp_path / "cli", "--stage", "distill", "--distill-cache", "static")) == 0
    assert seen == ["static"]
    assert main(llama.argv(tmp_path / "cli", "--resume", "--max-steps", 1, "--distill-cache", "dynamic")) == 0
    assert seen == ["static"] and _progress(tmp_path / "cli")["step"] == 1  # resumed on the cached answers
    recipe = llama.write_recipe("recipe_cache.json", distill_cache="paged")
    capsys.readouterr()
    assert main(llama.argv(tmp_path / "bad", recipe=recipe)) == 2
    assert "distill_cache must be dynamic or static, not 'paged'" in _one_line_error(capsys)
    assert not (tmp_path / "bad").exists()


def test_a_journal_keeps_answers_with_line_separators_and_drops_a_line_cut_inside_a_character(tmp_path):
    """An answer may hold U+2028 (a line break to str.splitlines, not to JSON lines); a write cut short inside
    a multi-byte character is dropped from the file, so that the next batch's line starts cleanly."""
    path = tmp_path / "journal" / "turn_1.jsonl"
    training.distill._append_journal(path, 0, ["one\u2028line", "é"])
    whole = path.read_bytes()
    path.write_bytes(whole + '{"batch": 2, "answers": ["☃'.encode()[:-1])  # cut inside the snowman's bytes
    assert training.distill._read_journal(path) == {0: ["one\u2028line", "é"]}
    assert path.read_bytes() == whole
    training.distill._append_journal(path, 2, ["two"])
    assert training.distill._read_journal(path) == {0: ["one\u2028line", "é"], 2: ["two"]}


def test_a_self_distillation_interrupted_in_the_cli_resumes_and_leaves_no_journal(llama, tmp_path, capsys,
                                                                                    monkeypatch):
    """A Ctrl-C after the first batch of the distill stage keeps that batch (exit 130, "--resume to
    continue"); --resume makes the rest, writes the cache byte for byte as one uninterrupted run does, and
    removes the journal."""
    sampled = ("--stage", "distill", "--distill-temperature", 0.7, "--distill-samples", 2)
    reference, out = tmp_path / "reference", tmp_path / "run"
    assert main(llama.argv(reference, *sampled)) == 0
    real = training.distill._append_journal

    def then_stop(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(training.distill, "_append_journal", then_stop)
    capsys.readouterr()
    assert main(llama.argv(out, *sampled)) == 130
    assert "run the same command with --resume to continue" in capsys.readouterr().err
    assert (out / "distill-journal").is_dir() and not (out / "distilled.jsonl.gz").exists()
    monkeypatch.setattr(training.distill, "_append_journal", real)
    assert main(llama.argv(out, "--resume", *sampled)) == 0
    assert not (out / "distill-journal").exists()
    assert (out / "distilled.jsonl.gz").read_bytes() == (reference / "distilled.jsonl.gz").read_bytes()


def test_the_distillation_batch_comes_from_the_command_line(llama, tmp_path, capsys, monkeypatch):
    """--distill-batch N overrides the recipe's batch of self-distillation (a number below 1 is refused in one
    line, before any work); a resume may change it."""
    seen = []
    real = training.distill._answer

    def answer(model, tokenizer, prompts, batch, *args, **kwargs):
        seen.append(batch)
        return real(model, tokenizer, prompts, batch, *args, **kwargs)

    monkeypatch.setattr(training.distill, "_answer", answer)
    assert main(llama.argv(tmp_path / "b", "--distill-batch", 0)) == 2
    assert "--distill-batch" in _one_line_error(capsys) and seen == []
    out = tmp_path / "a"
    assert main(llama.argv(out, "--stage", "distill", "--distill-batch", 1, "--distill-turns", 1)) == 0
    assert main(llama.argv(out, "--resume", "--stage", "distill", "--distill-batch", 5, "--distill-turns", 2)) == 0
    assert seen == [1, 5] and RECIPE["distill_batch"] not in seen


def test_sampled_distillation_settings_are_checked_and_recorded(llama, tmp_path, capsys):
    """distill_samples > 1 needs a temperature; a cache's settings file from before these settings counts
    as greedy (kept for a greedy recipe, refused for a sampled one); the settings are written with the cache."""
    assert main(llama.argv(tmp_path / "a", "--distill-samples", 2)) == 2
    assert "needs distill_temperature > 0" in _one_line_error(capsys)
    assert main(llama.argv(tmp_path / "b", "--distill-temperature", -1)) == 2
    assert "--distill-temperature must be at least 0" in _one_line_error(capsys)
    out = tmp_path / "run"
    assert main(llama.argv(out, "--stage", "distill")) == 0
    settings = json.loads((out / "distilled.json").read_text())
    assert settings["distill_temperature"] == 0 and settings["distill_samples"] == 1
    old = {k: v for k, v in settings.items() if k not in ("distill_temperature", "distill_samples")}
    (out / "distilled.json").write_text(json.dumps(old))
    assert main(llama.argv(out, "--stage", "distill", "--resume")) == 0
    capsys.readouterr()
    assert main(llama.argv(out, "--stage", "distill", "--resume", "--distill-temperature", 0.7)) == 2
    assert "distilled with other settings" in _one_line_error(capsys)
    sampled = tmp_path / "sampled"
    assert main(llama.argv(sampled, "--stage", "distill", "--distill-temperature", 0.7, "--distill-samples", 2)) == 0
    with gzip.open(sampled / "distilled.jsonl.gz", "rt") as f:
        ids = [json.loads(line)["id"] for line in f]
    assert len(ids) == 2 * RECIPE["distill_count"] and len(set(ids)) == len(ids)


def _stats(out: str, key: str) -> dict:
    """The JSON line of main()'s stdout that holds ``key``."""
    return next(json.loads(line) for line in out.splitlines() if line.startswith("{") and key in json.loads(line))


def test_extra_distilled_answers_join_the_training_set(llama, tmp_path, capsys):
    """--extra-distilled: an earlier run's answers are trained on beside this run's (sampled beside greedy);
    the same answer twice counts once; held-out conversations' answers (a sampled one's id is <id>#<s>) are
    left out; a file of original answers, and answers "original" with extra ones, are refused."""
    greedy = tmp_path / "greedy"
    assert main(llama.argv(greedy, "--stage", "distill")) == 0
    cache = greedy / "distilled.jsonl.gz"
    made = list(read_conversations(cache))
    capsys.readouterr()
    sampled = tmp_path / "sampled"
    assert main(llama.argv(sampled, "--stage", "distill", "--distill-temperature", 0.7, "--extra-distilled", cache)) == 0
    assert _stats(capsys.readouterr().out, "distilled") == {"distilled": len(made), "extra_distilled": len(made),
                                                             "distill_s": pytest.approx(0, abs=60)}
    assert main(llama.argv(tmp_path / "again", "--stage", "distill", "--extra-distilled", cache)) == 0
    assert _stats(capsys.readouterr().out, "distilled")["extra_distilled"] == 0  # the same greedy answers
    held = next(f"h{i}" for i in range(1000) if training.cli._is_val(f"h{i}", RECIPE["val_fraction"]))
    kept = next(f"k{i}" for i in range(1000) if not training.cli._is_val(f"k{i}", RECIPE["val_fraction"]))
    answer = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]
    extra = tmp_path / "extra.jsonl.gz"
    write_conversations([Conversation(i, 0, "distill:test", answer[:1] + [{"role": "assistant", "content": i}])
                         for i in (held, f"{held}#1", kept, f"{kept}#1")], extra)
    out = tmp_path / "train"
    assert main(llama.argv(out, "--epochs", 1, "--extra-distilled", extra)) == 0
    stats = _stats(capsys.readouterr().out, "conversations")
    assert stats["extra_distilled"] == 2
    assert json.loads((out / "run.json").read_text())["data"][-1]["sha256"] == hashlib.sha256(extra.read_bytes()).hexdigest()
    assert main(llama.argv(tmp_path / "bad", "--extra-distilled", llama.data)) == 2
    assert "is not the target's answer" in _one_line_error(capsys)
    assert main(llama.argv(tmp_path / "orig", "--extra-distilled", extra, "--answers", "original")) == 2
    assert "answers \"original\" leaves out" in _one_line_error(capsys)
    assert main(llama.argv(tmp_path / "missing", "--extra-distilled", tmp_path / "none.jsonl.gz")) == 2
    _one_line_error(capsys)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "missing").exists()  # refused before any work


def test_a_distilled_cache_of_other_settings_is_refused(llama, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(llama.argv(out, "--epochs", 1)) == 0
    assert json.loads((out / "distilled.json").read_text())["distill_turns"] == 1
    capsys.readouterr()
    recipe = llama.write_recipe("recipe_tokens.json", distill_new_tokens=9)
    assert main(llama.argv(out, "--resume", recipe=recipe)) == 2
    assert "distilled with other settings" in _one_line_error(capsys)
    (out / "distilled.json").write_text(json.dumps({**json.loads((out / "distilled.json").read_text()),
                                                    "distill_turns": 3}))
    assert main(llama.argv(out, "--resume", "--distill-turns", 2)) == 2  # fewer turns than the cache
    assert "distilled with other settings" in _one_line_error(capsys)
    assert main(llama.argv(tmp_path / "other", "--distill-turns", 0)) == 2
    assert "--distill-turns must be at least 1" in _one_line_error(capsys)


@pytest.mark.parametrize("sidecar", [True, False])
def test_a_distilled_cache_is_extended_to_more_turns(llama, tmp_path, monkeypatch, sidecar):
    """A cache of first turns (with its settings file, or from an older run without one) and a recipe with
    2 turns: only turn 2 is generated, from the cached first answers; the cache and its settings become
    those of 2 turns, the same as distilling 2 turns from scratch."""
    convs = llama.convs
    data = tmp_path / "two_turns.jsonl.gz"  # each conversation continues with the next one's user message
    write_conversations([dataclasses.replace(c, messages=c.messages + convs[(i + 1) % len(convs)].messages[:1])
                         for i, c in enumerate(convs)], data)
    out, scratch = tmp_path / "run", tmp_path / "scratch"
    assert main(llama.argv(out, "--stage", "distill", data=data)) == 0
    if not sidecar:
        (out / "distilled.json").unlink()
    first = (out / "distilled.jsonl.gz").read_bytes()
    calls = []
    real = training.distill.distill

    def spy(*args, **kwargs):
        calls.append(args[8] if len(args) > 8 else kwargs.get("done_turns", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(training.distill, "distill", spy)
    assert main(llama.argv(out, "--resume", "--stage", "distill", "--distill-turns", 2, data=data)) == 0
    assert calls == [1]
    assert json.loads((out / "distilled.json").read_text())["distill_turns"] == 2
    assert main(llama.argv(scratch, "--stage", "distill", "--distill-turns", 2, data=data)) == 0
    assert calls == [1, 0]
    extended, fresh = (list(read_conversations(d / "distilled.jsonl.gz")) for d in (out, scratch))
    assert extended == fresh and (out / "distilled.jsonl.gz").read_bytes() != first
    assert any(sum(m["role"] == "assistant" for m in c.messages) == 2 for c in extended)


class Killed(Exception):
    pass


def test_killed_run_resumes_to_the_same_head(llama, tmp_path, monkeypatch):
    """A run killed mid-epoch right after a checkpoint, then resumed, ends with exactly the head of an
    uninterrupted run (same batches, same optimizer state, same noise stream): the resume is lossless."""
    recipe = llama.write_recipe("recipe_ck.json", epochs=2, checkpoint_every=2)
    ref_out, out = tmp_path / "reference", tmp_path / "killed"
    assert main(llama.argv(ref_out, recipe=recipe)) == 0

    real_save = training.train.save_checkpoint

    def save_then_die(out_dir, head, opt, step, epoch, log, schedule=None, rngs=None):
        real_save(out_dir, head, opt, step, epoch, log, schedule, rngs)
        if step == 2:
            raise Killed()

    monkeypatch.setattr(training.train, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        main(llama.argv(out, recipe=recipe))
    monkeypatch.setattr(training.train, "save_checkpoint", real_save)
    assert not (out / "head").exists()  # nothing that looks like a finished run
    assert _progress(out)["step"] == 2 and _progress(out)["epoch"] == 0 and _log(ref_out)[0]["step"] > 2  # mid-epoch

    monkeypatch.setattr(training.distill, "distill", lambda *a, **k: pytest.fail("distilled again"))
    assert main(llama.argv(out, "--resume", recipe=recipe)) == 0
    assert _progress(out)["step"] == _progress(ref_out)["step"]
    ref_head, head = load_file(ref_out / "head" / "model.safetensors"), load_file(out / "head" / "model.safetensors")
    assert all(torch.equal(ref_head[k], head[k]) for k in ref_head)
    ref_opt = load_file(ref_out / "checkpoint" / "optimizer.safetensors")
    opt = load_file(out / "checkpoint" / "optimizer.safetensors")
    assert all(torch.equal(ref_opt[k], opt[k]) for k in ref_opt)


def test_stop_after_splits_a_run_over_calls_losslessly(llama, tmp_path, capsys):
    """--stop-after ends a call with a checkpoint and no exported head; calls resumed with --resume, one
    step each, then one to the end, give exactly the head of one uninterrupted call."""
    recipe = llama.write_recipe("recipe_stop.json", epochs=2, max_steps=5)
    ref_out, out = tmp_path / "reference", tmp_path / "split"
    assert main(llama.argv(ref_out, recipe=recipe)) == 0
    assert main(llama.argv(out, "--stop-after", 0, recipe=recipe)) == 0
    assert '"stopped": true' in capsys.readouterr().out
    assert not (out / "head").exists() and _progress(out)["step"] == 1
    assert main(llama.argv(out, "--resume", "--stop-after", 0, recipe=recipe)) == 0
    assert not (out / "head").exists() and _progress(out)["step"] == 2
    assert main(llama.argv(out, "--resume", recipe=recipe)) == 0
    assert _progress(out)["step"] == _progress(ref_out)["step"] == 5
    ref_head, head = load_file(ref_out / "head" / "model.safetensors"), load_file(out / "head" / "model.safetensors")
    assert all(torch.equal(ref_head[k], head[k]) for k in ref_head)
    assert _progress(out)["train_s"] > 0 and json.loads((out / "head" / "config.json").read_text())["training"]["train_s"] > 0


def test_a_stopped_run_continues_elsewhere_from_its_checkpoint_and_fingerprint(llama, tmp_path, capsys):
    """What another machine needs to continue a stopped run (eval/device/head.sh's RUNS_FROM): its checkpoint
    and run.json in a new run folder, and the same data (at another path, prepared again: equal bytes). The
    head equals an uninterrupted run's; other data is refused in one line."""
    recipe = llama.write_recipe("recipe_move.json", epochs=2, max_steps=4)
    ref_out, out, moved = tmp_path / "reference", tmp_path / "here", tmp_path / "there" / "run"
    assert main(llama.argv(ref_out, recipe=recipe)) == 0
    assert main(llama.argv(out, "--stop-after", 0, recipe=recipe)) == 0
    moved.mkdir(parents=True)
    shutil.copytree(out / "checkpoint", moved / "checkpoint")
    shutil.copy(out / "run.json", moved / "run.json")
    data = tmp_path / "there" / "train.jsonl"
    assert write_conversations(llama.convs, data) == N_CONVS
    other = tmp_path / "there" / "other.jsonl"
    write_conversations(llama.convs[1:], other)
    capsys.readouterr()
    assert main(llama.argv(moved, "--resume", recipe=recipe, data=other)) == 2
    assert "other data" in capsys.readouterr().err
    assert main(llama.argv(moved, "--resume", recipe=recipe, data=data)) == 0
    assert _progress(moved)["step"] == _progress(ref_out)["step"] == 4
    ref_head, head = load_file(ref_out / "head" / "model.safetensors"), load_file(moved / "head" / "model.safetensors")
    assert all(torch.equal(ref_head[k], head[k]) for k in ref_head)


def test_a_fitted_schedule_survives_resume(llama, tmp_path, monkeypatch):
    """A time budget fixes the run's length once (saved with the checkpoint); a resumed call follows it
    rather than the recipe's epochs."""
    recipe = llama.write_recipe("recipe_fit.json", epochs=30, checkpoint_every=1000)
    out = tmp_path / "run"
    rates = []
    real_lr = training.train.lr_at
    monkeypatch.setattr(training.train, "lr_at", lambda step, total, r: rates.append((step, total)) or real_lr(step, total, r))
    # a budget that the first step spends ends the run right there
    assert main(llama.argv(out, "--time-budget", 1e-6, "--stop-after", 1e9, recipe=recipe)) == 0
    progress = _progress(out)
    assert progress["fitted"] and progress["total"] == progress["step"] == 1
    rates.clear()
    assert main(llama.argv(out, "--resume", recipe=recipe)) == 0  # nothing left to train
    assert rates == [] and _progress(out)["step"] == 1


class _Clock:
    """A stand-in for the trainer's ``time`` module: every ``perf_counter()`` call is ``tick`` s later."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


def test_a_time_budget_shortens_the_run_at_step_60(llama, tmp_path, monkeypatch):
    """Steps that fit the first 60 into the budget but not the recipe's length: the fit at step 60 ends the
    run at the step where the budget runs out (with the schedule's full decay); the same budget spent before
    step 60 ends the run there."""
    recipe = llama.write_recipe("recipe_fit60.json", epochs=30, checkpoint_every=1000)
    clock = _Clock(0.5)
    monkeypatch.setattr(training.train, "time", clock)
    out = tmp_path / "run"
    assert main(llama.argv(out, "--time-budget", 100, recipe=recipe)) == 0
    progress, steps_per_epoch = _progress(out), _log(out)[0]["step"]
    assert progress["fitted"] and 60 < progress["total"] == progress["step"] < 30 * steps_per_epoch - 5
    clock = _Clock(5.0)
    monkeypatch.setattr(training.train, "time", clock)
    slow = tmp_path / "slow"
    assert main(llama.argv(slow, "--time-budget", 100, recipe=recipe)) == 0
    assert _progress(slow)["fitted"] and _progress(slow)["step"] < 60


def test_init_warm_starts_from_a_head(llama, tmp_path, capsys):
    """--init loads a head's weights before training (with lr 0 they come out unchanged); a head of
    another shape is refused before the run folder is made."""
    first = tmp_path / "first"
    assert main(llama.argv(first, "--epochs", 1)) == 0
    still = llama.write_recipe("recipe_lr0.json", epochs=1, lr=0.0)
    second = tmp_path / "second"
    assert main(llama.argv(second, "--init", first / "head", recipe=still)) == 0
    a, b = load_file(first / "head" / "model.safetensors"), load_file(second / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((second / "head" / "recipe.json").read_text())["init"] == str(first / "head")
    training_info = json.loads((second / "head" / "config.json").read_text())["training"]
    assert training_info["init_sha256"] == hashlib.sha256((first / "head" / "model.safetensors").read_bytes()).hexdigest()
    capsys.readouterr()

    from transformers import AutoConfig

    fits = HeadConfig.for_target(AutoConfig.from_pretrained(llama.target))
    out = tmp_path / "refused"
    for name, change, expected in (("narrow", {"hidden_size": 16, "intermediate_size": 32}, "hidden size 16"),
                                   ("wide-mlp", {"intermediate_size": 2 * fits.intermediate_size}, "another shape")):
        other = tmp_path / name
        save_head(EagleHead(dataclasses.replace(fits, **change)), other)
        assert main(llama.argv(out, "--init", other)) == 2
        err = _one_line_error(capsys)
        assert str(other) in err and expected in err, err
        assert not out.exists()
    assert main(llama.argv(out, "--init", tmp_path / "no-head")) == 2
    assert "no draft head" in _one_line_error(capsys)
    assert not out.exists()


def test_checkpoint_round_trip_restores_optimizer(tmp_path):
    """save_checkpoint / load_checkpoint directly: a fresh head and AdamW get back the exact weights and
    moments, and the next step from either is identical."""
    torch.manual_seed(0)
    cfg = HeadConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=8)

    def make():
        head = EagleHead(cfg)
        return head, torch.optim.AdamW(head.parameters(), lr=1e-2, betas=(0.9, 0.95))

    def step(head, opt, seed):
        g = torch.Generator().manual_seed(seed)
        x, f = torch.randn(1, 5, 16, generator=g), torch.randn(1, 5, 16, generator=g)
        opt.zero_grad()
        head(x, f, torch.arange(5)[None]).square().mean().backward()
        opt.step()

    head, opt = make()
    for seed in range(3):
        step(head, opt, seed)
    training.train.save_checkpoint(tmp_path, head, opt, 3, 1, [{"epoch": 1}])
    head2, opt2 = make()
    assert training.train.load_checkpoint(tmp_path, head2, opt2) == (3, 1, [{"epoch": 1}], {})
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for k in a[i]:
            assert torch.equal(a[i][k], b[i][k]), (i, k)
    step(head, opt, 9)
    step(head2, opt2, 9)
    assert all(torch.equal(p, q) for p, q in zip(head.parameters(), head2.parameters()))


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_unrolled_steps_are_the_draft_chain(tmp_path, arch):
    """EagleHead.unroll (training-time test) computes what drafting computes: step j's row t equals the
    head run through its cache on the prefix 0..t (target features; eagle3: fc of the captured layers'
    states) and then j chained rows fed their own outputs, each seeing the prefix and the chain so far.
    Step 0 is the teacher-forced forward."""
    torch.manual_seed(0)
    eagle3 = dict(arch="eagle3", layers=(0, 1, 2), draft_vocab_size=4) if arch == "eagle3" else {}
    cfg = HeadConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=8,
                     **eagle3)
    head = EagleHead(cfg).eval()
    b, t, steps, slots = 2, 6, 3, 16
    embeds, features = torch.randn(b, t + steps - 1, 32), torch.randn(b, t, 96 if eagle3 else 32)
    with torch.no_grad():
        preds = head.unroll(embeds, features, steps)
        read = head.fuse(features) if eagle3 else features  # what a committed row reads
        assert len(preds) == steps and all(p.shape == (b, t, 32) for p in preds)
        assert torch.equal(preds[0], head(embeds[:, :t], read, torch.arange(t).expand(b, -1)))
        for row in range(b):
            for anchor in range(t):
                cache = head.new_cache(slots, torch.device("cpu"), torch.float32)
                n = anchor + 1
                allowed = torch.ones(n, slots, dtype=torch.bool).tril()
                x = head(embeds[row:row + 1, :n], read[row:row + 1, :n], torch.arange(n)[None], cache,
                         torch.arange(n), _additive(allowed))[:, -1:]
                for j in range(1, steps):
                    slot = n + j - 1
                    sees = torch.zeros(1, slots, dtype=torch.bool)
                    sees[0, :slot + 1] = True
                    x = head(embeds[row:row + 1, anchor + j:anchor + j + 1], x, torch.tensor([[anchor + j]]), cache,
                             torch.tensor([slot]), _additive(sees))
                    torch.testing.assert_close(x[0, 0], preds[j][row, anchor], atol=1e-5, rtol=1e-5)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[None, None]


def _loss_batch():
    """ids, attention and loss mask of two sequences of 9 tokens (the second padded after 7), answers from 4."""
    ids = torch.randint(0, VOCAB, (2, 9))
    attn = torch.ones(2, 9, dtype=torch.bool)
    attn[1, 7:] = False
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 4:] = True
    return ids, attn, mask


def test_one_step_loss_is_eagles_and_later_steps_count_shifted_rows(llama):
    """head_loss with unroll 1 is EAGLE's loss (SmoothL1 on f_{t+1} + ce_weight x soft CE) over assistant
    rows; with unroll 2 it is the decay-weighted mean of step 0's loss and step 1's over rows shifted by
    one (the last row, past the sequence's end, never counts)."""
    import torch.nn.functional as F

    from training.recipe import Recipe

    model, _ = load_target(str(llama.target), torch.device("cpu"), torch.float32)
    from fsd_eagle.target import Target

    target = Target(model)
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(model.config))
    ids, attn, mask = _loss_batch()
    recipe = Recipe(noise=0.0)
    f = target.base(input_ids=ids, attention_mask=attn.long()).last_hidden_state.detach()

    def step_loss(pred, j):
        rows = (mask & attn)[:, 1 + j:]
        p, q = pred[:, :rows.shape[1]][rows], f[:, 1 + j:][rows]
        ce = -(target.logits(q).softmax(-1) * torch.log_softmax(target.logits(p), -1)).sum(-1).mean()
        return F.smooth_l1_loss(p, q) + recipe.ce_weight * ce

    preds = head.unroll(target.embed(F.pad(ids[:, 1:], (0, 1))), f[:, :-1], 2)
    loss1, metrics1 = training.train.head_loss(head, target, ids, attn, mask, recipe)
    torch.testing.assert_close(loss1, step_loss(preds[0], 0))
    assert metrics1["acc"].shape == (1,)
    loss2, metrics2 = training.train.head_loss(head, target, ids, attn, mask, dataclasses.replace(recipe, unroll=2))
    torch.testing.assert_close(loss2, (step_loss(preds[0], 0) + 0.8 * step_loss(preds[1], 1)) / 1.8)
    assert metrics2["acc"].shape == (2,)


def test_eagle3_loss_is_the_cross_entropy_over_the_draft_vocabulary(llama):
    """An eagle3 head's loss: no feature term; each step's soft CE of the head's draft logits against the
    target's next-token distribution restricted to the draft vocabulary and renormalised, over the rows
    whose target top token is a draft token; steps weighed as for eagle2."""
    import torch.nn.functional as F

    from fsd_eagle.target import Target
    from training.recipe import Recipe

    model, _ = load_target(str(llama.target), torch.device("cpu"), torch.float32)
    target = Target(model)
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(model.config, arch="eagle3", draft_vocab_size=64))
    head.set_draft_vocab(torch.randperm(VOCAB))
    draft = head.draft_ids()
    assert int(head.t2d.sum()) == 64 and torch.equal(head.t2d.nonzero()[:, 0], draft)
    ids, attn, mask = _loss_batch()
    out = target.base(input_ids=ids, attention_mask=attn.long(), output_hidden_states=True)
    f = out.last_hidden_state.detach()
    states = torch.cat([out.hidden_states[i] for i in head.config.layers], -1).detach()
    preds = head.unroll(target.embed(F.pad(ids[:, 1:], (0, 1))), states[:, :-1], 2)

    def step_loss(pred, j):
        rows = (mask & attn)[:, 1 + j:]
        logits = target.logits(f[:, 1 + j:][rows])
        keep = head.t2d[logits.argmax(-1)]
        assert keep.any()
        ce = -(logits[:, draft].softmax(-1) * torch.log_softmax(head.draft_logits(pred[:, :rows.shape[1]][rows]), -1))
        return ce.sum(-1)[keep].mean()

    loss, metrics = training.train.head_loss(head, target, ids, attn, mask, Recipe(unroll=2))
    torch.testing.assert_close(loss, (step_loss(preds[0], 0) + 0.8 * step_loss(preds[1], 1)) / 1.8)
    assert metrics["feat"].abs().sum() == 0 and metrics["acc"].shape == (2,)


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
def test_a_compiled_loss_equals_the_eager_one_on_every_batch_shape_and_trains_from_the_command_line(llama, tmp_path):
    """recipe.compile (--compile on): the loss's pieces run compiled (training.train.loss_parts); the loss and
    the head's gradients equal the eager ones (float32) on batches of two shapes, the second compiled by the
    first's dynamic-shape compilation (no new graph), and a run trains with it; a non-boolean value is refused."""
    from torch._dynamo.utils import counters

    from fsd_eagle.target import Target
    from training.recipe import Recipe

    model, _ = load_target(str(llama.target), torch.device("cpu"), torch.float32)
    target = Target(model)
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(model.config, arch="eagle3", draft_vocab_size=64))
    head.set_draft_vocab(torch.randperm(VOCAB))
    graphs = []
    for b, t in [(2, 9), (3, 13)]:
        ids, attn, mask = torch.randint(0, VOCAB, (b, t)), torch.ones(b, t, dtype=torch.bool), torch.zeros(b, t,
                                                                                                     dtype=torch.bool)
        attn[1, t - 2:], mask[:, 3:] = False, True
        losses, grads = [], []
        for compiled in (False, True):
            head.zero_grad(set_to_none=True)
            loss, _ = training.train.head_loss(head, target, ids, attn, mask, Recipe(unroll=2, compile=compiled))
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in head.parameters() if p.grad is not None])
        torch.testing.assert_close(losses[1], losses[0])
        assert len(grads[1]) == len(grads[0]) > 0
        for compiled_grad, eager_grad in zip(grads[1], grads[0]):
            torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0] > 0
    recipe = llama.write_recipe("recipe_compiled.json", arch="eagle3", draft_vocab_size=64)
    out = tmp_path / "compiled"
    assert main(llama.argv(out, "--max-steps", 2, "--compile", "on", recipe=recipe)) == 0
    assert _progress(out)["step"] == 2 and json.loads((out / "head" / "recipe.json").read_text())["compile"] is True
    assert main(llama.argv(tmp_path / "bad", recipe=llama.write_recipe("recipe_bad.json", compile="yes"))) == 2
    assert not (tmp_path / "bad").exists()


def test_unroll_trains_and_logs_each_step(llama, tmp_path):
    """--unroll 2 overrides the recipe, is recorded in the exported recipe, and the log has each step's
    feature loss, CE and accuracy (step 0's also as feat/ce/acc)."""
    out = tmp_path / "unrolled"
    assert main(llama.argv(out, "--epochs", 1, "--unroll", 2)) == 0
    entry = _log(out)[-1]
    assert len(entry["acc_by_step"]) == len(entry["ce_by_step"]) == len(entry["feat_by_step"]) == 2
    assert entry["acc"] == entry["acc_by_step"][0] and entry["ce"] == entry["ce_by_step"][0]
    assert json.loads((out / "head" / "recipe.json").read_text())["unroll"] == 2


def test_eagle3_trains_resumes_exports_and_decodes_exactly(llama, tmp_path, capsys):
    """--arch eagle3: the head reads the default target layers, drafts over the most frequent answer tokens
    (d2t/t2d from the token ranking), learns (CE falls, no feature loss), resumes losslessly from a
    checkpoint, and the exported head reloads as an eagle3 head that decodes exactly as plain decoding."""
    recipe = llama.write_recipe("recipe_eagle3.json", arch="eagle3", draft_vocab_size=64, epochs=4)
    ref_out, out = tmp_path / "reference", tmp_path / "split"
    assert main(llama.argv(ref_out, "--unroll", 2, recipe=recipe)) == 0
    log = _log(ref_out)
    assert all("feat" not in e and "feat_by_step" not in e and len(e["ce_by_step"]) == 2 for e in log)
    # the tiny random target's next-token distributions are nearly flat: CE stays near their entropy
    assert log[-1]["ce"] < log[0]["ce"] - 0.1 and log[-1]["acc"] > 2 * log[0]["acc"], log

    assert main(llama.argv(out, "--unroll", 2, "--stop-after", 0, recipe=recipe)) == 0
    assert '"stopped": true' in capsys.readouterr().out and not (out / "head").exists()
    assert main(llama.argv(out, "--unroll", 2, "--resume", recipe=recipe)) == 0
    ref_head, saved = load_file(ref_out / "head" / "model.safetensors"), load_file(out / "head" / "model.safetensors")
    assert ref_head.keys() == saved.keys() and all(torch.equal(ref_head[k], saved[k]) for k in ref_head)

    config = json.loads((out / "head" / "config.json").read_text())
    model, tokenizer = load_target(llama.target, torch.device("cpu"), torch.float32)
    n = model.config.num_hidden_layers
    assert (config["arch"], config["draft_vocab_size"]) == ("eagle3", 64)
    assert config["layers"] == sorted(min(max(i, 0), n - 1) for i in (2, n // 2, n - 3))
    assert {"d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight"} <= saved.keys()
    assert saved["lm_head.weight"].shape == (64, model.config.hidden_size) and saved["t2d"].dtype == torch.bool
    assert not any(k.startswith("layers.") for k in saved)
    head = load_head(out / "head", model.config, torch.device("cpu"), torch.float32)
    assert head.config.eagle3
    # the draft columns are the 64 most frequent answer tokens, in id order
    top = head.token_ranking[:64].sort().values
    assert torch.equal(head.draft_ids(), top) and int(head.t2d.sum()) == 64 and head.t2d[top].all()
    gen = SpeculativeGenerator(model, tokenizer, head)
    for prompt in [c.messages[:1] for c in llama.convs[:3]] + [UNSEEN["llama"]]:
        spec, ref = gen.generate(prompt, 24), gen.generate(prompt, 24, autoregressive=True)
        assert spec.token_ids == ref.token_ids and spec.text == ref.text


def test_a_wider_head_trains_for_max_steps_and_decodes_exactly(llama, tmp_path):
    """--head-intermediate-size gives the head an MLP of that width (a capacity variant: the config and
    weights say so and it loads as such), --max-steps caps the run from the command line, and the wider head
    decodes exactly as plain decoding; a width that does not fit a warm start's head is refused in one line."""
    recipe = llama.write_recipe("recipe_wide.json", arch="eagle3", draft_vocab_size=64, epochs=4)
    out = tmp_path / "wide"
    assert main(llama.argv(out, "--head-intermediate-size", 96, "--max-steps", 2, recipe=recipe)) == 0
    assert _log(out)[-1]["step"] == 2
    config = json.loads((out / "head" / "config.json").read_text())
    saved = load_file(out / "head" / "model.safetensors")
    model, tokenizer = load_target(llama.target, torch.device("cpu"), torch.float32)
    assert config["intermediate_size"] == 96 != model.config.intermediate_size
    assert [tuple(v.shape) for k, v in saved.items() if k.endswith("mlp.down_proj.weight")] == [
        (model.config.hidden_size, 96)]
    head = load_head(out / "head", model.config, torch.device("cpu"), torch.float32)
    assert head.config.intermediate_size == 96
    gen = SpeculativeGenerator(model, tokenizer, head)
    for prompt in [c.messages[:1] for c in llama.convs[:2]] + [UNSEEN["llama"]]:
        spec, ref = gen.generate(prompt, 24), gen.generate(prompt, 24, autoregressive=True)
        assert spec.token_ids == ref.token_ids
    assert main(llama.argv(tmp_path / "narrow", "--init", str(out / "head"), "--head-intermediate-size", 48,
                           recipe=recipe)) == 2


# ------------------------------------------------------------------------------------- 4: bad input


def _write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


_RECORD = b'{"id": "c%d", "index": %d, "source": "s", "messages": []}\n'
BAD_DATA = {
    "missing": (None, "not found"),
    "empty": ("", "empty"),
    "blank lines": ("\n  \n", "empty"),
    "not json": ('{"id": "a", "index": 0, "source": "s", "messages": []}\nnot json\n', "line 2: not valid JSON"),
    "not a record": ('{"messages": [{"role": "user", "content": "w5"}]}\n', "not a conversation record"),
    "bad role": ('{"id": "a", "index": 0, "source": "s", "messages": [{"role": "bot", "content": "w5"}]}\n',
                 "not a conversation record"),
    "not an object": ("[1, 2]\n", "expected a JSON object"),
    "binary": (b"\xff\xfe\x00garbage\x80\n", "cannot decode"),
    "truncated gzip": (gzip.compress(b"".join(_RECORD % (i, i) for i in range(2000)))[:4000], "cannot decode"),
}


def _one_line_error(capsys) -> str:
    """The one ``error: ...`` line main() printed last on stderr (progress bars may precede it)."""
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines and "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]], err
    return lines[-1]


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_dataset_file(llama, tmp_path, capsys, case):
    content, expected = BAD_DATA[case]
    _assert_refused(llama, tmp_path, capsys, "data", tmp_path / "data.jsonl", content, expected)


def _assert_refused(llama, tmp_path, capsys, arg: str, path: Path, content, expected: str) -> None:
    """A run given ``path`` (holding ``content``; None = missing) as its ``arg`` input fails with exit 2 and
    one error line that names the file and says ``expected``, and creates nothing."""
    if content is not None:
        _write(path, content)
    out = tmp_path / "run"
    assert main(llama.argv(out, **{arg: path})) == 2
    err = _one_line_error(capsys)
    assert expected in err and str(path) in err
    assert not out.exists()  # nothing created, let alone a head/ folder


def _no_model_dirs(root: Path, target: Path) -> dict:
    empty = root / "empty"
    empty.mkdir()
    bad_config = root / "bad_config"
    bad_config.mkdir()
    _write(bad_config / "config.json", "{not json")
    no_weights = root / "no_weights"
    no_weights.mkdir()
    _write(no_weights / "config.json", (target / "config.json").read_text())
    return {"missing": root / "nowhere", "empty folder": empty, "a file": _write(root / "file.bin", "x"),
            "bad config": bad_config, "config without weights": no_weights}


@pytest.mark.parametrize("case", ["missing", "empty folder", "a file", "bad config", "config without weights"])
def test_target_without_a_model(llama, tmp_path, capsys, case):
    target = _no_model_dirs(tmp_path, llama.target)[case]
    out = tmp_path / "run"
    assert main(llama.argv(out, target=target)) == 2
    err = _one_line_error(capsys)
    assert str(target) in err and ("no model" in err or "cannot load" in err), err
    assert not out.exists()


def _previous_run(out: Path) -> dict:
    (out / "checkpoint").mkdir(parents=True)
    _write(out / "checkpoint" / "progress.json", json.dumps({"step": 7, "epoch": 1, "log": []}))
    _write(out / "distilled.jsonl.gz", gzip.compress(b""))
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_out_folder_with_previous_run_needs_resume_or_overwrite(llama, tmp_path, capsys):
    out = tmp_path / "run"
    before = _previous_run(out)
    assert main(llama.argv(out)) == 2
    err = _one_line_error(capsys)
    assert str(out) in err and "--resume" in err and "--overwrite" in err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before and not (out / "head").exists()  # the previous run is untouched

    # --overwrite with bad input fails before deleting anything
    assert main(llama.argv(out, "--overwrite", data=tmp_path / "missing.jsonl")) == 2
    _one_line_error(capsys)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_overwrite_never_removes_an_input_or_a_folder_that_is_not_a_run(llama, tmp_path, capsys):
    """--overwrite clears only a run folder of ours (its .fsd-eagle file, or an older run's run.json), and
    never one that holds the run's data, target or recipe: those are refused in one line, nothing removed."""
    import shutil

    inside = tmp_path / "holds_inputs"
    shutil.copytree(llama.target, inside / "target")
    shutil.copy(llama.data, inside / "data.jsonl")
    shutil.copy(llama.recipe, inside / "recipe.json")
    (inside / ".fsd-eagle").write_text("{}")  # even a folder marked ours is kept while it holds an input
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    cases = [(llama.argv(inside, "--overwrite", data=inside / "data.jsonl"), inside, "an input of this command"),
             (llama.argv(inside, "--overwrite", target=inside / "target"), inside, "an input of this command"),
             (llama.argv(inside, "--overwrite", recipe=inside / "recipe.json"), inside, "an input of this command"),
             (llama.argv(notes, "--overwrite"), notes, "was not written by fsd-eagle")]
    for argv, folder, words in cases:
        before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        assert main(argv) == 2
        assert words in _one_line_error(capsys)
        assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_out_is_a_file(llama, tmp_path, capsys):
    out = _write(tmp_path / "out", "x")
    assert main(llama.argv(out)) == 2
    assert "is a file" in _one_line_error(capsys)
    assert out.read_text() == "x"


@pytest.mark.parametrize("content, expected", [
    (json.dumps({**RECIPE, "epochz": 3}), "unknown keys: epochz"),
    (json.dumps({**RECIPE, "answers": "mine"}), "answers must be both, distilled or original"),
    (json.dumps({**RECIPE, "distill_turns": 0}), "distill_turns must be at least 1"),
    (json.dumps({**RECIPE, "unroll": 0}), "unroll must be at least 1"),
    (json.dumps({**RECIPE, "arch": "eagle4"}), "arch must be eagle2 or eagle3, not 'eagle4'"),
    (json.dumps({**RECIPE, "layers": [1, 2, 3]}), "layers and draft_vocab_size are eagle3 settings"),
    (json.dumps({**RECIPE, "arch": "eagle3", "layers": [1, -2]}), "layers must be a list of target layer ids >= 0"),
    (json.dumps({**RECIPE, "arch": "eagle3", "layers": [0, 1, 9]}), "reads target layers [0, 1, 9], the target has"),
    (json.dumps({**RECIPE, "arch": "eagle3", "draft_vocab_size": 500}), "draft_vocab_size must be an integer from 0"),
    (json.dumps({**RECIPE, "epochs": "6"}), "epochs must be an integer, got '6'"),
    (json.dumps({**RECIPE, "lr": None}), "lr must be a number, got None"),
    ("{oops", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (None, "not found"),
])
def test_bad_recipe(llama, tmp_path, capsys, content, expected):
    _assert_refused(llama, tmp_path, capsys, "recipe", tmp_path / "recipe.json", content, expected)


# ------------------------------------------------------------------------------ Ctrl-C, threads, budget


def _stderr_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip()]


def test_ctrl_c_saves_a_checkpoint_and_the_head_so_far(llama, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of an epoch: exit 130, one line saying where the checkpoint and the head so far are
    and how to --resume; the head so far loads; the resumed run ends with exactly an uninterrupted run's head
    and removes the partial one."""
    recipe = llama.write_recipe("recipe_ctrl_c.json", epochs=2)
    ref_out, out = tmp_path / "reference", tmp_path / "interrupted"
    assert main(llama.argv(ref_out, recipe=recipe)) == 0
    capsys.readouterr()

    real_loss, calls = training.train.head_loss, []

    def interrupt_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(training.train, "head_loss", interrupt_third_step)
    assert main(llama.argv(out, recipe=recipe)) == 130
    last = _stderr_lines(capsys)[-1]
    assert last.startswith("interrupted at step 2 of ") and str(out / "checkpoint") in last, last
    assert str(out / "head-partial") in last and "--resume" in last
    assert _progress(out)["step"] == 2 and not (out / "head").exists()
    config = json.loads((out / "head-partial" / "config.json").read_text())
    assert config["training"]["interrupted_at_step"] == 2
    load_head(out / "head-partial", load_target(llama.target, torch.device("cpu"), torch.float32)[0].config,
              torch.device("cpu"), torch.float32)

    monkeypatch.setattr(training.train, "head_loss", real_loss)
    assert main(llama.argv(out, "--resume", recipe=recipe)) == 0
    ref_head, head = load_file(ref_out / "head" / "model.safetensors"), load_file(out / "head" / "model.safetensors")
    assert all(torch.equal(ref_head[k], head[k]) for k in ref_head)
    assert not (out / "head-partial").exists()


def test_a_real_ctrl_c_mid_step_resumes_to_the_uninterrupted_head_and_log(llama, tmp_path, monkeypatch, capsys):
    """SIGINT delivered in the middle of a step (after its input noise was drawn): the step finishes, the
    interrupt lands at the step boundary, and --resume ends with exactly an uninterrupted run's head; the
    epoch's logged loss covers all its steps, not only the resumed ones."""
    import signal

    recipe = llama.write_recipe("recipe_sigint.json", epochs=1)
    ref_out, out = tmp_path / "reference", tmp_path / "interrupted"
    assert main(llama.argv(ref_out, recipe=recipe)) == 0
    capsys.readouterr()
    real_loss, calls = training.train.head_loss, []

    def signal_in_second_step(*args, **kwargs):
        calls.append(1)
        result = real_loss(*args, **kwargs)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(training.train, "head_loss", signal_in_second_step)
    assert main(llama.argv(out, recipe=recipe)) == 130
    assert _progress(out)["step"] == 2 < _log(ref_out)[0]["step"]  # mid-epoch
    monkeypatch.setattr(training.train, "head_loss", real_loss)
    assert main(llama.argv(out, "--resume", recipe=recipe)) == 0
    ref_head, head = load_file(ref_out / "head" / "model.safetensors"), load_file(out / "head" / "model.safetensors")
    assert all(torch.equal(ref_head[k], head[k]) for k in ref_head)
    (ref_entry,), (entry,) = _log(ref_out), _log(out)
    assert {k: v for k, v in entry.items() if k != "seconds"} == {k: v for k, v in ref_entry.items() if k != "seconds"}


def test_ctrl_c_in_validation_keeps_the_epoch(llama, tmp_path, monkeypatch, capsys):
    """Ctrl-C while an epoch's validation decodes: the epoch's steps are in the checkpoint (a resumed run
    starts the next epoch), exit 130."""
    recipe = llama.write_recipe("recipe_ctrl_c_val.json", epochs=2)
    out = tmp_path / "run"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(SpeculativeGenerator, "generate", interrupt)
    assert main(llama.argv(out, recipe=recipe)) == 130
    assert "--resume" in _stderr_lines(capsys)[-1]
    progress = _progress(out)
    assert progress["epoch"] == 1 and progress["step"] == progress["log"][0]["step"] > 0
    assert "val_tau" not in progress["log"][0]


def test_ctrl_c_before_training(llama, tmp_path, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training.distill, "distill", interrupt)
    out = tmp_path / "run"
    assert main(llama.argv(out)) == 130
    assert _stderr_lines(capsys)[-1] == "interrupted before training started: run the same command again"


def test_validation_stops_at_the_time_budget(llama, tmp_path, capsys):
    """Validation counts in --time-budget: once it is spent, training ends (here at its first step) and the
    validation decodes one prompt only (the recipe has two) and says so; progress lines name the long steps."""
    recipe = llama.write_recipe("recipe_val_budget.json", epochs=2)
    out = tmp_path / "run"
    assert main(llama.argv(out, "--time-budget", 1e-6, recipe=recipe)) == 0
    lines = _stderr_lines(capsys)
    assert any(line.startswith("self-distillation: the target answers") for line in lines)
    assert any(line.startswith("tokenizing ") for line in lines)
    assert any("validation (tau)" in line for line in lines)
    log = _log(out)
    assert len(log) == 1 and log[0]["step"] == 1 and log[0]["val_prompts_decoded"] == 1
    assert main(llama.argv(tmp_path / "unbounded", recipe=recipe)) == 0
    assert all("val_prompts_decoded" not in e and "val_tau" in e for e in _log(tmp_path / "unbounded"))


def test_bad_threads_option(llama, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(llama.argv(out, "--threads", 0)) == 2
    assert "threads must be an integer >= 1" in _one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_a_loss_taken_in_chunks_of_rows_has_the_same_value_and_gradients(llama, arch, monkeypatch):
    """A batch whose rows x vocabulary exceed MAX_LOGIT_ELEMENTS (a 262k vocabulary) is taken in chunks of
    rows, each checkpointed: the loss, its metrics and the head's gradients are those of one block."""
    from fsd_eagle.target import Target
    from training.recipe import Recipe

    model, _ = load_target(str(llama.target), torch.device("cpu"), torch.float32)
    target = Target(model)
    torch.manual_seed(0)
    extra = {"arch": "eagle3", "draft_vocab_size": 64} if arch == "eagle3" else {}
    head = EagleHead(HeadConfig.for_target(model.config, **extra))
    if arch == "eagle3":
        head.set_draft_vocab(torch.randperm(VOCAB))
    ids, attn, mask = _loss_batch()
    recipe = Recipe(noise=0.0, unroll=2)

    def loss_and_grads():
        head.zero_grad(set_to_none=True)
        loss, metrics = training.train.head_loss(head, target, ids, attn, mask, recipe)
        loss.backward()
        return loss.detach(), metrics, {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}

    whole = loss_and_grads()
    monkeypatch.setattr(training.train, "MAX_LOGIT_ELEMENTS", 3 * VOCAB)  # 3 rows per chunk
    assert len(training.train.row_chunks(8, VOCAB)) == 3
    chunked = loss_and_grads()
    torch.testing.assert_close(chunked[0], whole[0])
    for key in ("ce", "acc"):
        torch.testing.assert_close(chunked[1][key], whole[1][key])
    assert chunked[2].keys() == whole[2].keys() and whole[2]
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, msg=name)


# ------------------------------------------------------------------------------------ data parallel


def _torchrun(argv: list[str], nproc: int = 2, timeout: float = 600) -> "subprocess.CompletedProcess":
    """``torchrun --standalone --nproc-per-node nproc -m training <argv>`` on the CPU (gloo)."""
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(nproc), "-m", "training", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _gloo_ok() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


@pytest.mark.skipif(not _gloo_ok(), reason="torch.distributed with gloo is not available")
def test_data_parallel_training_over_two_processes(llama, tmp_path, capsys):
    """torchrun with two processes: each trains on every other batch (an epoch is half the batches' steps),
    gradients averaged, replicas checked equal at the end, one head exported (recording the two processes).
    A run stopped after its first step (--stop-after 0) keeps both processes' random streams and, resumed by
    two processes, ends with exactly the head of the uninterrupted two-process run."""
    recipe = llama.write_recipe("recipe_ddp.json", epochs=2, distill=False, val_prompts=0)
    ref, split = tmp_path / "ddp", tmp_path / "ddp_split"
    r = _torchrun(llama.argv(ref, recipe=recipe))
    assert r.returncode == 0, r.stderr[-3000:]
    log = _log(ref)
    single = tmp_path / "single"
    assert main(llama.argv(single, recipe=recipe)) == 0
    assert log[0]["step"] == _log(single)[0]["step"] // 2  # two batches per step
    config = json.loads((ref / "head" / "config.json").read_text())
    assert config["training"]["data_parallel_processes"] == 2
    assert r.stdout.count('"head": ') == 1  # process 0 alone reports and exports

    r = _torchrun(llama.argv(split, "--stop-after", 0, recipe=recipe))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _progress(split)["step"] == 1 and not (split / "head").exists()
    assert (split / "checkpoint" / "rng.safetensors").is_file() and (split / "checkpoint" / "rng_1.safetensors").is_file()
    assert main(llama.argv(split, "--resume", recipe=recipe)) != 0  # one process cannot continue two's run
    assert "made by 2 data-parallel process(es): resume it with as many" in capsys.readouterr().err
    r = _torchrun(llama.argv(split, "--resume", recipe=recipe))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(ref / "head" / "model.safetensors"), load_file(split / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not _gloo_ok(), reason="torch.distributed with gloo is not available")
def test_data_parallel_self_distillation_is_shared(llama, tmp_path):
    """Two processes share the self-distillation (each answers every other conversation) and process 0
    caches what one process makes: the same conversations, answers and order (greedy, float32)."""
    recipe = llama.write_recipe("recipe_ddp_distill.json", distill_count=7, distill_batch=3)
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(llama.argv(one, "--stage", "distill", recipe=recipe)) == 0
    r = _torchrun(llama.argv(two, "--stage", "distill", recipe=recipe))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count('"distilled": 7') == 1 and "shared by 2 processes" in r.stderr
    made = [(c.id, c.messages) for c in read_conversations(two / "distilled.jsonl.gz")]
    assert made == [(c.id, c.messages) for c in read_conversations(one / "distilled.jsonl.gz")] and len(made) == 7
    assert (two / "distilled.json").read_text() == (one / "distilled.json").read_text()
    # sampled answers made by both processes, the greedy ones added from the first run's file
    r = _torchrun(llama.argv(tmp_path / "three", "--stage", "distill", "--distill-temperature", 0.7,
                             "--extra-distilled", one / "distilled.jsonl.gz", recipe=recipe))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count('"distilled": 7, "extra_distilled": 7') == 1


def _average_rank(rank: int, port: int, queue) -> None:
    """One of two gloo processes: gradients (rank + 1) x [1, 2, 3] and (for rank 0 only) a second parameter's
    gradient; returns the averaged gradients and whether a deliberately drifted replica is caught."""
    import os

    import torch.distributed as dist

    from training.ddp import Ranks, average_gradients, check_in_sync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ranks = Ranks(2, rank, rank)
        a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        a.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        b.grad = torch.ones(2, dtype=torch.bfloat16) * 4 if rank == 0 else None
        average_gradients([a, b], ranks)
        module = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(module.weight, float(rank))  # replicas that differ
        try:
            check_in_sync(module, ranks)
            caught = False
        except RuntimeError:
            caught = True
        queue.put((rank, a.grad.tolist(), b.grad.float().tolist(), b.grad.dtype == torch.bfloat16, caught))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not _gloo_ok(), reason="torch.distributed with gloo is not available")
def test_gradients_are_averaged_over_processes_and_drift_is_caught():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_average_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((item[0], item[1:]) for item in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    for rank in (0, 1):
        a, b, b_bf16, caught = got[rank]
        assert a == [1.5, 3.0, 4.5] and b == [2.0, 2.0] and b_bf16 and caught


def test_the_progress_bar_ends_full_when_max_steps_ends_the_epoch_early(llama, tmp_path, capsys):
    recipe = llama.write_recipe("recipe_bar.json", epochs=1, max_steps=2)
    assert main(llama.argv(tmp_path / "run", recipe=recipe)) == 0
    err = capsys.readouterr().err
    assert "2/2" in err and "2/3" not in err, err[-500:]
