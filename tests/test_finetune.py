"""``python -m training finetune`` and ``python -m training draft-model`` on tiny random Llama targets (CPU):
the exported folders load and generate, the answer mask is exactly what the evaluation prompts, training
resumes where it stopped, the draft model keeps greedy output exact and distillation lowers its KL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import TreeConfig
from fsd_eagle.models import load_target
from test_training import byte_tokenizer
from training.__main__ import main
from training.data import Conversation, iter_arith_train, write_conversations
from training.draft_model import build_draft_model, make_kl_loss
from training.features import collate
from training.lm_recipe import LMRecipe
from training.lm_train import tokenize_answers

VOCAB = 128
RECIPE = dict(max_len=160, tokens_per_batch=640, epochs=2, lr=3e-3, warmup_steps=1, val_fraction=0.1,
              checkpoint_every=2, save_dtype="float32", seed=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved 4-layer tiny Llama with a ChatML byte tokenizer, arithmetic conversations and a recipe."""
    root = tmp_path_factory.mktemp("finetune")
    target = root / "target"
    model = tiny_model("llama", vocab_size=VOCAB, num_layers=4)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(target)
    byte_tokenizer().save_pretrained(target)
    convs = [Conversation(c.id, c.index, c.source, [{"role": m["role"], "content": m["content"][:60]}
                                                    for m in c.messages])
             for c in iter_arith_train(24, eval_prompts=False)]
    data = root / "train.jsonl"
    write_conversations(convs, data)
    recipe = root / "recipe.json"
    recipe.write_text(json.dumps(RECIPE))
    return {"root": root, "target": target, "data": data, "recipe": recipe}


def finetune_argv(setup, out: Path, *extra) -> list[str]:
    return ["finetune", str(setup["recipe"]), "--out", str(out), "--target", str(setup["target"]),
            "--data", str(setup["data"]), "--device", "cpu", *map(str, extra)]


def test_answer_mask_starts_after_the_generation_prompt_the_generator_uses(setup):
    """The trained tokens are exactly the answer after the ids a generator is given for the question, up
    to and including the end-of-turn token."""
    model, tok = load_target(str(setup["target"]), torch.device("cpu"), torch.float32)
    gen = SpeculativeGenerator(model, tok)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    ex = tokenize_answers(tok, msgs, 512, frozenset([2]))
    prompt = gen.encode("What is 2 + 3?")
    assert list(ex.ids[: len(prompt)]) == prompt and not ex.mask[: len(prompt)].any()
    assert tok.decode(ex.ids[ex.mask]) == "5<|im_end|>"


def test_finetune_exports_a_loadable_model_and_resumes_losslessly(setup, tmp_path, capsys):
    """Two calls of one step each (--stop-after 0, then --resume) end with the weights of one uninterrupted
    run; the folder is a complete model that SpeculativeGenerator.load takes and that generates."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(finetune_argv(setup, whole, "--max-steps", "4")) == 0
    assert main(finetune_argv(setup, split, "--max-steps", "4", "--stop-after", "0")) == 0
    assert json.loads((split / "checkpoint" / "progress.json").read_text())["step"] == 1
    assert main(finetune_argv(setup, split, "--max-steps", "4", "--resume")) == 0
    capsys.readouterr()
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json",
                 "recipe.json", "training.json", "README.md"):
        assert (whole / "model" / name).is_file(), name
    a, _ = load_target(str(whole / "model"), torch.device("cpu"), torch.float32)
    b, _ = load_target(str(split / "model"), torch.device("cpu"), torch.float32)
    before, _ = load_target(str(setup["target"]), torch.device("cpu"), torch.float32)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), before.state_dict().values()):
        torch.testing.assert_close(x, y, msg=name)
    assert any(not torch.equal(x, z) for x, z in zip(a.state_dict().values(), before.state_dict().values()))
    gen = SpeculativeGenerator.load(target=str(whole / "model"), device="cpu")
    r = gen.generate("Ava has 5 coins.", 8, autoregressive=True)
    assert r.stats.new_tokens >= 1
    log = json.loads((whole / "model" / "training.json").read_text())["log"]
    assert log[-1]["step"] == 4 and "val_loss" in log[-1]


def test_finetune_lowers_the_answer_loss(setup, tmp_path, capsys):
    out = tmp_path / "ft"
    assert main(finetune_argv(setup, out, "--epochs", "6")) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    epochs = [x for x in lines if "epoch" in x]
    assert epochs[-1]["loss"] < 0.8 * epochs[0]["loss"]


@pytest.mark.parametrize("case, expected", [
    ("no_data", "no training data"),
    ("bad_recipe", "lr must be"),
    ("unknown_key", "unknown keys: lrr"),
    ("busy_out", "already holds a run"),
    ("resume_other", "another run"),
])
def test_bad_input_is_one_line(setup, tmp_path, capsys, case, expected):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({**RECIPE, **({"lr": -1} if case == "bad_recipe" else {}),
                                  **({"lrr": 1} if case == "unknown_key" else {})}))
    out = tmp_path / "out"
    argv = ["finetune", str(recipe), "--out", str(out), "--target", str(setup["target"]), "--device", "cpu"]
    if case != "no_data":
        argv += ["--data", str(setup["data"])]
    if case in ("busy_out", "resume_other"):
        assert main(argv + ["--max-steps", "1"]) == 0
        if case == "resume_other":
            argv += ["--resume", "--epochs", "5"]
    capsys.readouterr()
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in errors[0]


# ------------------------------------------------------------------------------------------ draft model


def test_draft_model_keeps_the_first_layers_and_decodes_exactly(setup, tmp_path, capsys):
    """The builder's model has K layers with the target's weights; as a chain drafter (gamma = 5) greedy
    decoding equals autoregressive decoding in fp32."""
    out = tmp_path / "draft"
    assert main(["draft-model", "--target", str(setup["target"]), "--layers", "2", "--out", str(out),
                 "--device", "cpu"]) == 0
    capsys.readouterr()
    target, _ = load_target(str(setup["target"]), torch.device("cpu"), torch.float32)
    draft, _ = load_target(str(out / "model"), torch.device("cpu"), torch.float32)
    assert draft.config.num_hidden_layers == 2 and type(draft) is type(target)
    t_state = target.state_dict()
    for name, value in draft.state_dict().items():
        torch.testing.assert_close(value, t_state[name], msg=name)
    gen = SpeculativeGenerator.load(target=str(setup["target"]), draft_model=str(out / "model"), device="cpu",
                                    tree=TreeConfig(total_tokens=6, depth=5, top_k=1))
    prompt = "Ava has 5 coins. How many?"
    ar = gen.generate(prompt, 40, autoregressive=True)
    sd = gen.generate(prompt, 40)
    assert sd.token_ids == ar.token_ids and sd.stats.target_forwards < sd.stats.new_tokens


def test_draft_model_of_a_tied_target_stays_tied():
    target = tiny_model("llama", vocab_size=VOCAB, num_layers=3, tie_word_embeddings=True)
    draft = build_draft_model(target, 2)
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight)
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():  # the draft's logits: the target's final norm and lm_head after its first 2 layers
        h_t = target(ids, output_hidden_states=True).hidden_states[2]
        expected = target.lm_head(target.model.norm(h_t))
        torch.testing.assert_close(draft(ids).logits, expected)


def test_draft_layers_out_of_range_are_refused(setup, tmp_path, capsys):
    assert main(["draft-model", "--target", str(setup["target"]), "--layers", "4", "--out",
                 str(tmp_path / "d"), "--device", "cpu"]) == 2
    assert "--layers must be from 1 to 3" in capsys.readouterr().err


def test_distillation_lowers_the_kl_and_resumes(setup, tmp_path, capsys):
    target, tok = load_target(str(setup["target"]), torch.device("cpu"), torch.float32)
    from training.data import read_conversations

    examples = [tokenize_answers(tok, c.messages, 160, frozenset([2])) for c in read_conversations(setup["data"])]
    ids, attn, mask = collate(examples, list(range(8)), torch.device("cpu"))
    loss = make_kl_loss(target)

    def kl_of(folder: Path) -> float:
        draft, _ = load_target(str(folder), torch.device("cpu"), torch.float32)
        with torch.no_grad():
            return float(loss(draft, ids, attn, mask)[0])

    with torch.no_grad():
        start = float(loss(build_draft_model(target, 1), ids, attn, mask)[0])
    recipe = tmp_path / "distill.json"
    recipe.write_text(json.dumps({**RECIPE, "epochs": 8, "lr": 1e-2}))
    base = ["draft-model", "--target", str(setup["target"]), "--layers", "1", "--data", str(setup["data"]),
            "--recipe", str(recipe), "--device", "cpu", "--out"]
    assert main(base + [str(tmp_path / "a")]) == 0
    assert kl_of(tmp_path / "a" / "model") < 0.7 * start
    assert main(base + [str(tmp_path / "b"), "--max-steps", "3", "--stop-after", "0"]) == 0
    assert main(base + [str(tmp_path / "b"), "--max-steps", "3", "--resume"]) == 0
    assert main(base + [str(tmp_path / "c"), "--max-steps", "3"]) == 0
    capsys.readouterr()
    b, _ = load_target(str(tmp_path / "b" / "model"), torch.device("cpu"), torch.float32)
    c, _ = load_target(str(tmp_path / "c" / "model"), torch.device("cpu"), torch.float32)
    for (name, x), y in zip(b.state_dict().items(), c.state_dict().values()):
        torch.testing.assert_close(x, y, msg=name)


def test_recipes_in_the_repository_load():
    root = Path(__file__).resolve().parents[1] / "training" / "recipes"
    for name in ("smollm2-135m-gsm8k-finetune.json", "smollm2-135m-gsm8k-finetune-cpu.json",
                 "smollm2-135m-draft-distill.json"):
        LMRecipe.load(root / name)
