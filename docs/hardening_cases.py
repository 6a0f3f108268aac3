"""Run every case of docs/hardening.md against a source tree and record what happens.

    python docs/hardening_cases.py TREE OUT.json [CASE_ID ...]

TREE is a checkout of fsd-eagle (e.g. an older commit from ``git archive``); its packages are imported from
there. Tiny fixtures (a random Llama target with a word tokenizer, a head, broken variants of both, training
data and recipes) are built once in a temporary folder; every case then runs in a forked child (torch and
transformers are imported once, before forking) with its own stdout, stderr, exit code and a 4 GiB
address-space limit (so a case that would allocate too much fails instead of exhausting the machine).
``python docs/hardening_cases.py --table BEFORE.json NOW.json`` prints the markdown table of docs/hardening.md.

A case is a CLI call (``module``, ``argv``), Python code (``code``) or a real process (``proc``, optionally
interrupted with SIGINT). Code prints ``RESULT: ...`` lines for outcomes that an exit code does not show
(wrong text, a surviving process, a head exported over another).
"""

from __future__ import annotations

import json
import os
import re
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

VOCAB = 128
PROMPT = "w5 w17 w99 w3 w42 w64 w8"
GEN = ["--device", "cpu", "--dtype", "float32", "--max-new-tokens", "12", "--total-tokens", "6", "--depth", "3",
       "--tree-top-k", "2"]


# ------------------------------------------------------------------------------------------------ fixtures


def word_tokenizer(vocab: int = VOCAB):
    """<unk> 0, <s> 1, </s> 2, then w3 .. w{vocab-1}; whitespace split; a chat template (as tests/test_api.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}{{ '<s> ' + m['content'] + ' ' }}{% endfor %}"
                      "{% if add_generation_prompt %}<s> {% endif %}")


def tiny_llama(vocab: int = VOCAB, seed: int = 0, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    model.generation_config.eos_token_id = None
    return model.float().eval()


def save_target(folder: Path, vocab: int = VOCAB, tokenizer_vocab: int | None = None, seed: int = 0) -> Path:
    model = tiny_llama(vocab, seed)
    model.save_pretrained(folder)
    word_tokenizer(tokenizer_vocab or vocab).save_pretrained(folder)
    return folder


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def edit_weights(folder: Path, drop_prefix: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith(drop_prefix)}, folder / "model.safetensors",
              metadata={"format": "pt"})


class Shell:
    """Pickles as a call of os.system (what a malicious pytorch_model.bin holds)."""

    def __reduce__(self):
        return os.system, ("true",)


def build_fixtures(root: Path) -> dict:
    """Every folder and file the cases use, by name."""
    import torch
    from fsd_eagle.head import EagleHead, HeadConfig
    from fsd_eagle.models import save_head, save_ranking

    f: dict[str, str] = {}
    target = save_target(root / "target")
    config = tiny_llama().config
    f["target"] = str(target)
    torch.manual_seed(3)
    head = EagleHead(HeadConfig.for_target(config))
    save_head(head, root / "head", dtype=torch.float32)
    save_ranking(torch.arange(VOCAB).flip(0), root / "head")
    f["head"] = str(root / "head")

    def copy(src: str, name: str) -> Path:
        shutil.copytree(src, root / name)
        f[name] = str(root / name)
        return root / name

    edit_weights(copy(f["target"], "target_missing_layer"), "model.layers.1.")
    edit_json(copy(f["target"], "target_more_layers") / "config.json", num_hidden_layers=3)
    edit_json(copy(f["target"], "target_wrong_shape") / "config.json", intermediate_size=4096)
    edit_json(copy(f["target"], "target_huge_vocab") / "config.json", vocab_size=400_000_000)
    remote = copy(f["target"], "target_remote_code")
    marker = root / "remote_code_ran"
    f["remote_marker"] = str(marker)
    (remote / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'llama'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    edit_json(remote / "config.json", model_type="evil_llama", auto_map={"AutoConfig": "evil.EvilConfig",
                                                "AutoModelForCausalLM": "evil.EvilModel"})
    save_target(root / "target_big_tokenizer", vocab=64, tokenizer_vocab=VOCAB)
    f["target_big_tokenizer"] = str(root / "target_big_tokenizer")
    save_target(root / "target_other", vocab=96, seed=1)
    f["target_other"] = str(root / "target_other")

    for name, changes in {"head_list_config": None, "head_string_sizes": {"hidden_size": "64"},
                          "head_zero_heads": {"num_attention_heads": 0},
                          "head_rope_missing_fields": {"rope_parameters": {"rope_type": "linear"}},
                          "head_string_eps": {"rms_norm_eps": "1e-6"},
                          "head_huge_intermediate": {"intermediate_size": 100_000_000}}.items():
        folder = copy(f["head"], name)
        if changes is None:
            (folder / "config.json").write_text("[1, 2]")
        else:
            edit_json(folder / "config.json", **changes)
    eagle_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}
    for name, payload in {"head_pickle_global": "global", "head_pickle_list": "list",
                          "head_pickle_garbage": "garbage"}.items():
        folder = root / name
        folder.mkdir()
        f[name] = str(folder)
        (folder / "config.json").write_text(json.dumps(eagle_config))
        if payload == "global":  # a pickle that would call os.system: weights_only refuses it
            torch.save({"fc.weight": Shell()}, folder / "pytorch_model.bin")
        elif payload == "list":
            torch.save([1, 2, 3], folder / "pytorch_model.bin")
        else:
            (folder / "pytorch_model.bin").write_bytes(b"\x80\x04\x95garbage pickle bytes" * 5)

    rng = __import__("random").Random(0)
    convs = [{"id": f"c{i}", "index": i, "source": "synthetic", "messages": [{"role": "user", "content": " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(8))},
                           {"role": "assistant", "content": " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(16))}]}
             for i in range(24)]
    data = root / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    f["data"] = str(data)
    other = root / "convs_other.jsonl"
    other.write_text("".join(json.dumps(c) + "\n" for c in convs[:20]))
    f["data_other"] = str(other)
    latin1 = root / "latin1.jsonl"
    latin1.write_bytes(json.dumps(convs[0], ensure_ascii=False).replace("synthetic", "caf\u00e9").encode("latin-1") + b"\n")
    f["data_latin1"] = str(latin1)
    recipe = dict(distill=True, distill_count=2, distill_batch=2, distill_new_tokens=4, distill_prompt_tokens=32,
                  max_len=64, tokens_per_batch=512, epochs=1, lr=5e-3, warmup_steps=1, val_fraction=0.1,
                  val_prompts=1, val_new_tokens=4, checkpoint_every=1000, seed=0)
    for name, changes in {"recipe": {}, "recipe_other": {"lr": 1e-3},
                          "recipe_negative_epochs": {"epochs": -1},
                          "recipe_zero_checkpoint": {"checkpoint_every": 0},
                          "recipe_zero_batch": {"tokens_per_batch": 0},
                          "recipe_negative_warmup": {"warmup_steps": -5},
                          "recipe_val_fraction": {"val_fraction": 1.5}}.items():
        path = root / f"{name}.json"
        path.write_text(json.dumps({**recipe, **changes}))
        f[name] = str(path)
    for name, lr in {"recipe_nan_lr": float("nan"), "recipe_inf_lr": float("inf")}.items():
        path = root / f"{name}.json"
        path.write_text(json.dumps({**recipe, "lr": lr}))  # NaN / Infinity literals, which json reads
        f[name] = str(path)
    latin1_recipe = root / "recipe_latin1.json"
    latin1_recipe.write_bytes(json.dumps({**recipe, "comment": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"))
    f["recipe_latin1"] = str(latin1_recipe)
    f["root"] = str(root)
    return f


# ---------------------------------------------------------------------------------------------------- cases

LOAD = """
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import TreeConfig
gen = SpeculativeGenerator.load(target=F['target'], head=F['head'], device='cpu', dtype='float32',
                                tree=TreeConfig(total_tokens=6, depth=3, top_k=2))
"""

CONCURRENT_STREAMS = LOAD + """
a_ref, b_ref = gen.generate('w5 w6 w7', 20).text, gen.generate('w90 w91 w92 w93', 20).text
sa, sb = gen.stream('w5 w6 w7', 20), gen.stream('w90 w91 w92 w93', 20)
a = b = ''
try:
    for _ in range(40):
        a += next(sa, ''); b += next(sb, '')
    print('RESULT: both streams finished;', 'texts correct' if (a, b) == (a_ref, b_ref) else 'texts WRONG, no error')
except Exception as e:
    print('RESULT: second stream refused:', type(e).__name__, str(e)[:90])
    sa.close()
    print('RESULT: after closing the first:', 'correct' if gen.generate('w90 w91 w92 w93', 20).text == b_ref else 'WRONG')
"""

CONCURRENT_THREADS = LOAD + """
import threading
prompts = ['w5 w6 w7', 'w90 w91 w92 w93', 'w40 w41', 'w11 w12 w13 w14 w15']
refs = {p: gen.generate(p, 24).text for p in prompts}
wrong, errors = [], []
def work(p):
    for _ in range(4):
        try:
            if gen.generate(p, 24).text != refs[p]:
                wrong.append(p)
        except Exception as e:
            errors.append(type(e).__name__)
threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
[t.start() for t in threads]; [t.join() for t in threads]
print(f'RESULT: 16 calls from 4 threads: {len(wrong)} wrong texts, {len(errors)} errors {sorted(set(errors))}')
"""

TRAIN = ["run", "{recipe}", "--out", "{root}/run_{case}", "--target", "{target}", "--data", "{data}", "--device", "cpu",
         "--workers", "1"]

RESUME = """
import io, contextlib, json, sys
try:
    from training.cli import main
except ImportError:
    from training.__main__ import main
out = F['root'] + '/resume_' + CASE
base = ['run', F['recipe'], '--out', out, '--target', F['target'], '--data', F['data'], '--device', 'cpu', '--workers', '1']
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # the first call's output
    assert main(base + ['--stop-after', '0']) == 0
args = dict(target=F['target'], data=F['data'], recipe=F['recipe'])
args.update(CHANGE)
code = main(['run', args['recipe'], '--out', out, '--target', args['target'], '--data', args['data'], '--device', 'cpu',
             '--workers', '1', '--resume'])
import pathlib
head = pathlib.Path(out) / 'head' / 'config.json'
vocab = json.loads(head.read_text())['vocab_size'] if head.exists() else None
print(f'RESULT: exit {code}; ' + (f'head/ exported for a vocabulary of {vocab}' if vocab else 'no head exported'))
sys.exit(code)
"""

HUMANEVAL = """
import fcntl, os, sys, tempfile, time
from eval.humaneval_exec import check_program
from eval.tasks import load_humaneval
p = load_humaneval(limit=1)[0]
scratch = tempfile.mkdtemp(); os.chmod(scratch, 0o777)
lock = os.path.join(scratch, 'lock'); open(lock, 'w').close(); os.chmod(lock, 0o666)
count = os.path.join(scratch, 'count'); open(count, 'w').close(); os.chmod(count, 0o666)
program = p.prompt + BODY.replace('@LOCK@', repr(lock)).replace('@COUNT@', repr(count))
t = time.monotonic()
passed, status = check_program(program, p.test, p.entry_point, timeout_s=2.0)
elapsed = time.monotonic() - t
def holders():  # processes (outside any PID namespace's view) that hold the lock file open
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            if any(os.readlink(f'/proc/{pid}/fd/{fd}') == lock for fd in os.listdir(f'/proc/{pid}/fd')):
                found.append(int(pid))
        except OSError:
            pass
    return found
time.sleep(0.2)
survivors = holders()
forks = os.path.getsize(count)
print(f'RESULT: {status!r} in {elapsed:.1f} s; ' + (f'{len(survivors)} processes SURVIVED' if survivors else
      'no process survived') + (f'; {forks} processes forked' if 'fork' in BODY else ''))
for _ in range(20):  # clean up what escaped
    for pid in holders():
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    time.sleep(0.05)
"""

WRONG = "    return not True\n"
HE_BODIES = {
    "prints the pass token": WRONG + "import __main__, os, sys\n"
                             "sys.stdout.write('\\n' + getattr(__main__, 'token', 'no-token') + '\\n'); sys.stdout.flush()\n"
                             "os._exit(0)\n",
    "sets pass variables, exits 0": WRONG + "import builtins, os\npassed = PASSED = True\nbuiltins.passed = True\n"
                                    "print('passed')\nos._exit(0)\n",
    "returns an always-equal object": "    class Yes:\n        def __eq__(self, other): return True\n"
                                      "        def __bool__(self): return True\n    return Yes()\n",
    "setsid() child sleeps": WRONG + "import fcntl, os, time\nr, w = os.pipe()\nif os.fork() == 0:\n"
                             "    os.setsid()\n    fd = os.open(@LOCK@, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                             "    os.write(w, b'x')\n    while True: time.sleep(0.2)\nos.read(r, 1)\n",
    "fork bomb": WRONG + "import fcntl, os, time\nfd = os.open(@LOCK@, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                 "c = os.open(@COUNT@, os.O_WRONLY | os.O_APPEND)\n"
                 "while os.fstat(c).st_size < 200:\n    try:\n        if os.fork() == 0: os.write(c, b'x')\n"
                 "    except OSError:\n        time.sleep(0.05)\nwhile True: time.sleep(0.2)\n",
    "correct program": "    s = sorted(numbers)\n    return any(b - a < threshold for a, b in zip(s, s[1:]))\n",
}

SECOND = """
import contextlib, io, json, os, pathlib, shutil, sys
from fsd_eagle.cli import main as cli_main
try:
    from training.cli import main as train_main
except ImportError:
    from training.__main__ import main as train_main
root = pathlib.Path(F['root']) / ('second_' + CASE)
root.mkdir()
GEN = GEN_ARGS
def run(main, *argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    return code, (lines[-1][:110] if lines else '')
def kept(path, before):
    return 'kept' if path.exists() and path.read_bytes() == before else 'CHANGED OR DELETED'
src = root / 'in.jsonl'
src.write_text(''.join(json.dumps({'prompt': p}) + '\\n' for p in ['w5 w6', 'w7 w8 w9', 'w10']))
model = ['--target', F['target'], '--head', F['head'], *GEN]
BODY
"""
SECOND_BODIES = {
    "--output FILE whose last line has no newline, then the model fails to load":
        "notes = root / 'notes.json'; original = bytes([123, 34, 97, 34, 58, 32, 49, 125])  # {\"a\": 1}\n"
        "notes.write_bytes(original)\n"
        "code, err = run(cli_main, 'generate', '--input', src, '--output', notes, '--target', root / 'nothing', *GEN)\n"
        "print(f'RESULT: exit {code}; notes.json {kept(notes, original)}')",
    "--output of a run rerun with another --max-new-tokens":
        "out = root / 'out.jsonl'\nrun(cli_main, 'generate', '--input', src, '--output', out, *model)\n"
        "before = out.read_bytes()\ncode, err = run(cli_main, 'generate', '--input', src, '--output', out, *model, "
        "'--max-new-tokens', '5')\nprint(f'RESULT: exit {code}: {err}; output {kept(out, before)}')",
    "--output of a run rerun after a line was inserted at the top of the input":
        "out = root / 'out.jsonl'\nrun(cli_main, 'generate', '--input', src, '--output', out, *model)\n"
        "src.write_text(json.dumps({'prompt': 'w99'}) + '\\n' + src.read_text())\nbefore = out.read_bytes()\n"
        "code, err = run(cli_main, 'generate', '--input', src, '--output', out, *model)\n"
        "print(f'RESULT: exit {code}: {err}; output {kept(out, before)}')",
    "training run --overwrite --out DIR where DIR holds --data":
        "d = root / 'dir'; d.mkdir(); data = d / 'data.jsonl'; shutil.copy(F['data'], data)\n"
        "code, err = run(train_main, 'run', F['recipe'], '--out', d, '--target', F['target'], '--data', data, "
        "'--device', 'cpu', '--workers', '1', '--overwrite')\n"
        "print(f'RESULT: exit {code}: {err}; --data ' + ('kept' if data.exists() else 'DELETED'))",
    "export RUN/head --out RUN --force (the head's parent)":
        "r = root / 'run'; shutil.copytree(F['head'], r / 'head'); (r / 'checkpoint').mkdir(); "
        "(r / 'checkpoint' / 'progress.json').write_text('{}')\n"
        "code, err = run(train_main, 'export', r / 'head', '--format', 'ours', '--out', r, '--force')\n"
        "print(f'RESULT: exit {code}: {err}; checkpoint ' + ('kept' if (r / 'checkpoint').exists() else 'DELETED'))",
    "head with a NaN weight, sampling with sampled children":
        "from safetensors.torch import load_file, save_file\nh = root / 'nan_head'; shutil.copytree(F['head'], h)\n"
        "st = load_file(h / 'model.safetensors'); k = next(k for k in sorted(st) if st[k].dim() == 2)\n"
        "st[k][0, 0] = float('nan')\n"
        "save_file(st, h / 'model.safetensors', metadata={'format': 'pt'})\n"
        "out = io.StringIO()\nwith contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "    code = cli_main(['generate', 'w5 w6 w7', '--target', F['target'], '--head', str(h), *GEN, "
        "'--temperature', '0.8', '--children', 'sampled', '--json'])\n"
        "text = json.loads(out.getvalue())['text'] if code == 0 else ''\n"
        "print(f'RESULT: exit {code}; ' + (f'text {text[:40]!r}' if code == 0 else err.getvalue().strip()[:110]))",
    "FuzzyConfig(threshold=10**400), SamplingConfig(temperature=10**400), FuzzyConfig(processed='no')":
        "from fsd_eagle.config import FuzzyConfig, SamplingConfig\n"
        "for make in (lambda: FuzzyConfig(threshold=10**400), lambda: SamplingConfig(temperature=10**400), "
        "lambda: FuzzyConfig(processed='no')):\n"
        "    try:\n        made = make(); print(f'RESULT: accepted {made!r:.60}')\n"
        "    except Exception as e:\n        print(f'RESULT: {type(e).__name__}: {str(e)[:70]}')",
    "a presets file whose _shapes is a string":
        "from fsd_eagle import trees_presets\np = root / 'presets.json'; p.write_text(json.dumps({'_shapes': 'chain-3'}))\n"
        "try:\n    trees_presets.named_shape('chain-3', p); print('RESULT: accepted')\n"
        "except Exception as e:\n    print(f'RESULT: {type(e).__name__}: {str(e)[:90]}')",
    "--input from a FIFO":
        "import threading\nfifo = root / 'in.fifo'; os.mkfifo(fifo)\n"
        "t = threading.Thread(target=lambda: fifo.write_text(src.read_text())); t.start()\n"
        "code, err = run(cli_main, 'generate', '--input', fifo, *model, '--quiet'); t.join(10)\n"
        "print(f'RESULT: exit {code} {err}')",
    "a float64 eagle3 head exported as stored (--format eagle3)":
        "import torch\nfrom fsd_eagle.head import EagleHead, HeadConfig\nfrom fsd_eagle.models import save_head\n"
        "from transformers import AutoConfig\ntorch.manual_seed(0)\n"
        "h = EagleHead(HeadConfig.for_target(AutoConfig.from_pretrained(F['target']), arch='eagle3', "
        "draft_vocab_size=128)).double()\nsave_head(h, root / 'f64', dtype=torch.float64)\n"
        "code, err = run(train_main, 'export', root / 'f64', '--format', 'eagle3', '--out', root / 'out')\n"
        "print(f'RESULT: exit {code}; config.json says torch_dtype ' + "
        "str(json.loads((root / 'out' / 'config.json').read_text()).get('torch_dtype')))",
    "torch's CPU allocator failing (its message, raised where the model loads)":
        "import resource, torch\nfrom fsd_eagle import cli as c\n"
        "big = src\n"
        "def load(args):\n    raise RuntimeError(\"[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
        "can't allocate memory: you tried to allocate 17179869184 bytes. Error code 12 (Cannot allocate memory)\")\n"
        "c.load_generator = load\n"
        "try:\n    code, err = run(cli_main, 'generate', '--input', big, *model, '--quiet'); "
        "print(f'RESULT: exit {code}: {err}')\n"
        "except RuntimeError as e:\n    print(f'RESULT: RuntimeError escaped the command line: {str(e)[:60]}')",
}

TRAIN_CASES = {
    "recipe: epochs -1": "recipe_negative_epochs", "recipe: checkpoint_every 0": "recipe_zero_checkpoint",
    "recipe: lr NaN": "recipe_nan_lr", "recipe: lr Infinity": "recipe_inf_lr",
    "recipe: tokens_per_batch 0": "recipe_zero_batch", "recipe: warmup_steps -5": "recipe_negative_warmup",
    "recipe: val_fraction 1.5": "recipe_val_fraction", "recipe file not UTF-8": "recipe_latin1",
}


def cases() -> list[dict]:
    """The table: id, item (the protection it checks, 1-7 as in docs/hardening.md), what is tried, and how it runs."""
    t, h = "{target}", "{head}"
    gen = ["generate", PROMPT, "--target", t, "--head", h, *GEN]
    out: list[dict] = [
        dict(item=1, what="two stream() iterators of one generator consumed alternately", code=CONCURRENT_STREAMS),
        dict(item=1, what="4 threads calling generate() on one generator", code=CONCURRENT_THREADS),
        dict(item=2, what="target safetensors without layer 1's weights", cli=["generate", PROMPT, "--target",
             "{target_missing_layer}", *GEN, "--json"]),
        dict(item=2, what="target config with 3 layers, weights for 2", cli=["generate", PROMPT, "--target",
             "{target_more_layers}", *GEN, "--json"]),
        dict(item=2, what="target config intermediate_size 4096, weights 128", cli=["generate", PROMPT, "--target",
             "{target_wrong_shape}", *GEN, "--json"]),
        dict(item=2, what="target config vocab_size 400,000,000 (weights: 128)", cli=["generate", PROMPT, "--target",
             "{target_huge_vocab}", *GEN, "--json"]),
        dict(item=3, what="target folder with auto_map + evil.py, stdin closed", proc=["fsd_eagle.cli", "generate",
             PROMPT, "--target", "{target_remote_code}", *GEN, "--json"], stdin=b"", marker="remote_marker"),
        dict(item=3, what="target folder with auto_map + evil.py, 'y' piped to stdin", proc=["fsd_eagle.cli",
             "generate", PROMPT, "--target", "{target_remote_code}", *GEN, "--json"], stdin=b"y\n",
             marker="remote_marker"),
        dict(item=4, what="head config intermediate_size 100,000,000 (weights: 128)", cli=[*gen[:5],
             "{head_huge_intermediate}", *GEN]),
    ]
    for name, body in HE_BODIES.items():
        out.append(dict(item=5, what=f"HumanEval/0 candidate: {name}", code=HUMANEVAL.replace("BODY", repr(body))))
    for name, change in {"another target (vocabulary 96)": {"target": "target_other"},
                         "another recipe (lr 1e-3)": {"recipe": "recipe_other"},
                         "other data (20 of 24 conversations)": {"data": "data_other"}}.items():
        out.append(dict(item=6, what=f"--resume with {name}", code=RESUME.replace(
            "CHANGE", "{" + ", ".join(f"{k!r}: F[{v!r}]" for k, v in change.items()) + "}")))
    for name, recipe in TRAIN_CASES.items():
        out.append(dict(item=6, what=name, module="training",
                        argv=[x.replace("{recipe}", "{" + recipe + "}") for x in TRAIN], out_dir=True))
    head_cases = {"head pytorch_model.bin: pickle of a non-weights global": "head_pickle_global",
                  "head pytorch_model.bin: pickle of a list": "head_pickle_list",
                  "head pytorch_model.bin: garbage pickle bytes": "head_pickle_garbage",
                  "head config.json is a list": "head_list_config",
                  "head config hidden_size \"64\" (a string)": "head_string_sizes",
                  "head config num_attention_heads 0": "head_zero_heads",
                  "head config rope_parameters {rope_type: linear} without factor": "head_rope_missing_fields",
                  "head config rms_norm_eps \"1e-6\" (a string)": "head_string_eps"}
    for name, folder in head_cases.items():
        out.append(dict(item=7, what=name, cli=[*gen[:5], "{" + folder + "}", *GEN]))
    out += [
        dict(item=7, what="prompt with bytes that are not UTF-8 (argv b'w5 \\xff\\xfe')", proc=["fsd_eagle.cli",
             "generate", b"w5 \xff\xfe", "--target", t, "--head", h, *GEN]),
        dict(item=7, what="training data prepare --jsonl FILE in Latin-1", module="training",
             argv=["data", "prepare", "--out", "{root}/prepared_{case}.jsonl", "--jsonl", "{data_latin1}"]),
        dict(item=7, what="training run --data FILE in Latin-1", module="training",
             argv=[x.replace("{data}", "{data_latin1}") for x in TRAIN], out_dir=True),
        dict(item=7, what="tokenizer of 128 words, model vocabulary 64; prompt 'w100'", cli=["generate", "w5 w100",
             "--target", "{target_big_tokenizer}", *GEN]),
        dict(item=7, what="chat message without 'content' ([{'role': 'user'}])",
             code=LOAD + "print('RESULT:', repr(gen.generate([{'role': 'user'}], 4).text))"),
        dict(item=7, what="chat message without 'role' ([{'content': 'w5'}])",
             code=LOAD + "print('RESULT:', repr(gen.generate([{'content': 'w5'}], 4).text))"),
        dict(item=7, what="chat message content 5 (not a string)",
             code=LOAD + "print('RESULT:', repr(gen.generate([{'role': 'user', 'content': 5}], 4).text))"),
        dict(item=7, what="--draft-vocab 1000 (vocabulary 128, head with a ranking)", cli=[*gen, "--draft-vocab",
             "1000", "--json"]),
        dict(item=7, what="Ctrl-C 1 s after start (python -m fsd_eagle.cli)", proc=["fsd_eagle.cli", *gen],
             sigint=1.0),
        dict(item=7, what="Ctrl-C 1 s after start (python -m training run)", proc=["training", *TRAIN], sigint=1.0),
        dict(item=7, what="Ctrl-C 1 s after start (python -m eval tau)", proc=["eval", "tau", "--target", t, "--head", h,
             "--device", "cpu", "--limit", "1"], sigint=1.0),
    ]
    extreme = {"--temperature 1e308": ["--temperature", "1e308"], "--temperature 1e-300": ["--temperature", "1e-300"],
               "--temperature inf": ["--temperature", "inf"], "--top-p nan": ["--top-p", "nan"],
               "--top-p 1e-300": ["--top-p", "1e-300", "--temperature", "1"],
               "--max-new-tokens 10**30": ["--max-new-tokens", str(10 ** 30)],
               "--seed 10**30": ["--seed", str(10 ** 30)], "--seed -1": ["--seed", "-1", "--temperature", "1"],
               "--top-k 10**30": ["--top-k", str(10 ** 30), "--temperature", "1"],
               "--total-tokens 10**9": ["--total-tokens", str(10 ** 9)], "--depth 10**9": ["--depth", str(10 ** 9)],
               "--support-top-k 10**30": ["--support-top-k", str(10 ** 30), "--threshold", "1"],
               "--threshold 1e308": ["--threshold", "1e308"]}
    for name, extra in extreme.items():
        out.append(dict(item=7, what=name, cli=[*gen, *extra, "--json"]))
    api = {"generate(max_new_tokens=10**30)": "gen.generate('w5 w6', 10**30).stop_reason",
           "generate(temperature=1e-300)": "gen.generate('w5 w6', 4, temperature=1e-300).text",
           "generate(top_p=float('nan'))": "gen.generate('w5 w6', 4, temperature=1, top_p=float('nan')).text",
           "generate(top_k=2**70)": "gen.generate('w5 w6', 4, temperature=1, top_k=2**70).text",
           "generate(seed=2**70)": "gen.generate('w5 w6', 4, temperature=1, seed=2**70).text",
           "generate(stop=['w5', 5])": "gen.generate('w5 w6', 4, stop=['w5', 5]).text",
           "TreeConfig(draft_vocab=10**6) on a vocabulary of 128": "gen.set_tree(6, 3, 2, 10**6)"}
    for name, expr in api.items():
        out.append(dict(item=7, what=name, code=LOAD + f"print('RESULT:', repr({expr})[:60])"))
    for name, body in SECOND_BODIES.items():  # the second pass (docs/hardening.md, "Second pass")
        out.append(dict(item=8, what=name, code=SECOND.replace("GEN_ARGS", repr(GEN)).replace("BODY", body)))
    for name, extra in {"--temperature 0.8 --top-k 10**30 --children sampled": [
            "--temperature", "0.8", "--top-k", str(10 ** 30), "--children", "sampled"],
            "--tp-size 3 outside torchrun (4 attention heads)": ["--tp-size", "3"]}.items():
        out.append(dict(item=8, what=name, cli=[*gen, *extra, "--json"]))
    for i, case in enumerate(out, 1):
        case["id"] = f"{case['item']}.{i:02d}"
    return out


# ------------------------------------------------------------------------------------------------- running


def run_in_child(case: dict, fixtures: dict, scratch: Path) -> dict:
    """Fork; the child runs the case with stdout/stderr to files and exits with the case's code."""
    out_file, err_file = scratch / f"{case['id']}.out", scratch / f"{case['id']}.err"
    fill = {**fixtures, "case": case["id"]}
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        limit = 4 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit + _vm_size(), limit + _vm_size()))
        code = 0
        try:
            if "code" in case:
                exec(compile(case["code"], f"<case {case['id']}>", "exec"), {"F": fixtures, "CASE": case["id"],
                                                                             "__name__": "__case__"})
            else:
                module = "fsd_eagle.cli" if "cli" in case else case["module"]
                sys.argv = [module, *[a.format(**fill) for a in case.get("cli", case.get("argv"))]]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    status = os.waitpid(pid, 0)[1]
    result = {"rc": os.waitstatus_to_exitcode(status), "out": out_file.read_text(errors="replace"),
              "err": err_file.read_text(errors="replace"), "seconds": round(time.monotonic() - started, 1)}
    if case.get("out_dir"):
        result["wrote"] = Path(f"{fixtures['root']}/run_{case['id']}").exists()
    return result


def _vm_size() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def run_process(case: dict, fixtures: dict, tree: Path) -> dict:
    """A real ``python -m MODULE ...`` process (optionally sent SIGINT after ``sigint`` seconds)."""
    fill = {**fixtures, "case": case["id"]}
    module, *argv = case["proc"]
    argv = [a if isinstance(a, bytes) else a.format(**fill) for a in argv]
    if case.get("marker"):
        Path(fixtures[case["marker"]]).unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=tree, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if "sigint" in case:
        time.sleep(case["sigint"])
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(case.get("stdin", b""), timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    result = {"rc": proc.returncode, "out": out.decode(errors="replace"), "err": err.decode(errors="replace"),
              "seconds": round(time.monotonic() - started, 1)}
    if case.get("marker"):
        result["marker"] = Path(fixtures[case["marker"]]).exists()
    return result


def summary(case: dict, r: dict) -> str:
    """One table cell: exit status, what stderr held, and the case's RESULT lines."""
    err_lines = [line for line in r["err"].replace("\r", "\n").splitlines() if line.strip()]
    results = [line[len("RESULT: "):] for line in r["out"].splitlines() if line.startswith("RESULT: ")]
    parts = [f"exit {r['rc']}"]
    raised = err_lines[-1] if err_lines and "Traceback" in r["err"] else ""
    if "code" in case and raised.startswith("fsd_eagle.errors."):  # the API raised one of our errors
        parts = [f"raises {_short(raised[len('fsd_eagle.errors.'):], 110)}"]
    elif "Traceback" in r["err"]:
        last = next((line for line in reversed(err_lines) if not line.startswith(" ")), "")
        parts.append(f"{len(err_lines)}-line traceback ({_short(last)})")
    elif err_lines and ("code" not in case or any(line.startswith("error:") for line in err_lines)):
        error_lines = [line for line in err_lines if line.startswith(("error:", "interrupted"))]
        shown = error_lines[-1] if error_lines else err_lines[-1]
        parts.append(f"{len(err_lines)} stderr line{'s' * (len(err_lines) > 1)}: {_code(_short(shown, 170))}")
    if "code" not in case and "proc" not in case and not results and r["rc"] == 0:
        parts.append("output: " + _short(r["out"].strip().splitlines()[-1] if r["out"].strip() else "(none)", 60))
    if r.get("marker") is not None:
        parts.append("evil.py RAN" if r["marker"] else "evil.py not run")
    if "proc" in case and "--json" in case["proc"]:
        parts.append("stdout: " + (_short(r["out"].strip(), 50) if r["out"].strip() else "empty"))
    if r.get("wrote") is not None:
        parts.append("run folder written" if r["wrote"] else "nothing written")
    parts += [_short(re.sub(r"^exit -?\d+; ", "", x), 160) for x in results]
    return "; ".join(parts) + f" ({r['seconds']} s)"


def _short(text: str, n: int = 90) -> str:
    text = re.sub(r"/tmp/fsd_hardening_\w+/", "…/", " ".join(text.split())).replace("|", "\\|")
    return text if len(text) <= n else text[: n - 3] + "..."


def _code(text: str) -> str:
    """``text`` as a markdown code span: one backtick each side, or two with a space where it holds backticks."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def run_all(tree: Path, out: Path, only: list[str]) -> None:
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    import torch  # noqa: F401  (heavy imports once, before forking)
    import transformers  # noqa: F401
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="fsd_hardening_"))
    os.chmod(root, 0o755)
    fixtures = build_fixtures(root)
    results = {}
    for case in cases():
        if only and case["id"] not in only:
            continue
        r = run_process(case, fixtures, tree) if "proc" in case else run_in_child(case, fixtures, root)
        results[case["id"]] = {"what": case["what"], "item": case["item"], "summary": summary(case, r), **r}
        print(f"{case['id']} {case['what']}: {results[case['id']]['summary']}", flush=True)
    out.write_text(json.dumps(results, indent=1))
    shutil.rmtree(root, ignore_errors=True)


def table(before: Path, now: Path) -> str:
    """The markdown table of two runs' results (cells rendered again from the stored outputs)."""
    b, n = json.loads(before.read_text()), json.loads(now.read_text())
    by_id = {case["id"]: case for case in cases()}
    rows = ["| # | input | before | now |", "| --- | --- | --- | --- |"]
    for key in sorted(set(b) | set(n), key=lambda k: (int(k.split(".")[0]), k)):
        case = by_id[key]
        cells = [summary(case, runs[key]) if key in runs else "-" for runs in (b, n)]
        rows.append(f"| {key} | {_short(case['what'], 200)} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        print(table(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        run_all(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3:])
