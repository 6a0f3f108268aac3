"""Self-distillation: the target answers the training prompts itself (batched on the GPU), so the head learns
the target's own continuations rather than ShareGPT's answers: its greedy answer, or several answers sampled
at a temperature (more data, and the contexts that sampled decoding meets)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .data import Conversation


@torch.no_grad()
def distill(model, tokenizer, convs: list[Conversation], batch: int, prompt_tokens: int, new_tokens: int,
            turns: int = 1, done: list[Conversation] = (), done_turns: int = 0, temperature: float = 0.0,
            samples: int = 1, seed: int = 0, progress: bool = True, journal: Path | None = None,
            cache: str = "dynamic") -> list[Conversation]:
    """Regenerate the first ``turns`` assistant turns of each conversation, turn by turn: turn k answers the
    conversation's k-th user message after the target's own earlier answers (the original answers are
    dropped), so every assistant turn of a result is the target's. Returns new conversations (source
    'distill:<source>'); one stops at its first empty answer.

    ``temperature`` 0: the greedy answer. Above 0: ``samples`` answers per conversation, each its own
    dialogue sampled from the target's distribution at that temperature (no top-k / top-p), ids
    ``<id>`` for the first and ``<id>#<s>`` for the others; ``seed`` fixes the draws (the same settings
    give the same answers).

    ``done``: an earlier result of the same settings with ``done_turns`` turns, extended here from turn
    ``done_turns`` on (a conversation it ended, or left out, stays so). ``progress``: show progress bars.
    ``journal``: a folder where each batch's answers are kept as it is made, so that a distillation
    interrupted (a Ctrl-C, a killed job, a machine's time ended) continues where it stopped when called again
    with the same arguments, to the answers an uninterrupted call gives (see ``_answer``). ``cache``: generate's
    KV cache, "dynamic" or "static" (see ``_answer``)."""
    made = {c.id: c.messages for c in done}
    copies = [(sample_id(c.id, s), c) for c in convs for s in range(samples)]
    dialogs = {i: list(made.get(i, [])) for i, _ in copies}  # the regenerated conversation so far
    alive = [(i, c) for i, c in copies if sum(m["role"] == "assistant" for m in dialogs[i]) == done_turns]
    for k in range(done_turns, turns):
        jobs = []
        for i, c in alive:
            msgs = _turn_prompt(c.messages, k)
            if msgs is not None:
                jobs.append((i, c, dialogs[i] + msgs))
        answers = _answer(model, tokenizer, [m for _, _, m in jobs], batch, prompt_tokens, new_tokens,
                          f"distill turn {k + 1}", temperature, (seed * 1000 + k) % 2**63, progress, journal, cache)
        alive = []
        for (i, c, msgs), answer in zip(jobs, answers):
            if answer:
                dialogs[i] = msgs + [{"role": "assistant", "content": answer}]
                alive.append((i, c))
    return [Conversation(i, c.index, f"distill:{c.source}", dialogs[i]) for i, c in copies if dialogs[i]]


def distill_shared(ranks, model, tokenizer, convs: list[Conversation], batch: int, prompt_tokens: int,
                   new_tokens: int, turns: int = 1, done: list[Conversation] = (), done_turns: int = 0,
                   temperature: float = 0.0, samples: int = 1, seed: int = 0,
                   journal: Path | None = None, cache: str = "dynamic") -> list[Conversation]:
    """``distill`` shared by data-parallel processes (training/ddp.py): process r answers conversations r,
    r + N, ... (sampled answers draw from a stream seeded per process), and every process gets all the
    answers, in the order one process would have made them. Alone: ``distill`` itself."""
    from .ddp import gather_objects

    if not ranks.parallel:
        return distill(model, tokenizer, convs, batch, prompt_tokens, new_tokens, turns, done, done_turns,
                       temperature, samples, seed, journal=journal, cache=cache)
    mine = distill(model, tokenizer, convs[ranks.rank::ranks.world], batch, prompt_tokens, new_tokens, turns, done,
                   done_turns, temperature, samples, seed + 7919 * ranks.rank, progress=ranks.is_main,
                   journal=journal, cache=cache)
    made = {c.id: c for part in gather_objects(mine, ranks) for c in part}
    return [made[i] for c in convs for i in (sample_id(c.id, s) for s in range(samples)) if i in made]


def sample_id(conversation_id: str, sample: int) -> str:
    """The id of a conversation's ``sample``-th distilled answer (the first keeps the conversation's id)."""
    return conversation_id if sample == 0 else f"{conversation_id}#{sample}"


def conversation_of(answer_id: str) -> str:
    """The id of the conversation that a distilled answer (``sample_id``) answers."""
    return answer_id.split("#")[0]


def _turn_prompt(messages: list[dict], k: int) -> list[dict] | None:
    """The messages that open turn k (0-based): those after the (k-1)-th user message's answer, up to and
    including the k-th user message, without the original assistant answers; None if there is no k-th."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if k >= len(users):
        return None
    start = users[k - 1] + 1 if k else 0
    return [m for m in messages[start: users[k] + 1] if m["role"] != "assistant"]


def _answer(model, tokenizer, prompts: list[list[dict]], batch: int, prompt_tokens: int, new_tokens: int,
            desc: str, temperature: float = 0.0, seed: int = 0, progress: bool = True,
            journal: Path | None = None, cache: str = "dynamic") -> list[str]:
    """The target's answer to each chat prompt (its last ``prompt_tokens`` tokens): greedy, or sampled at
    ``temperature`` (the random state seeded from ``seed`` and the batch before each batch, so that a batch's
    answers do not depend on the batches made before it), in batches of similar lengths (less padding);
    answers in the order of ``prompts``.

    ``journal``: a folder where each batch's answers are appended as it is made, in a file named by a digest
    of everything they depend on (the token ids of the prompts, the batch size and the generation settings);
    batches found there are not made again. The caller removes the folder once the answers are kept.

    ``cache`` "dynamic": each batch as long as its longest prompt, with transformers' default cache, which
    grows by a concatenation of the whole cache every step. "static": a static cache written in place, and every
    batch one shape [batch, prompt_tokens] (prompts left-padded to ``prompt_tokens``, a last short batch filled
    up with copies of its last prompt, whose answers are dropped; fewer prompts than ``batch``: one batch of
    them all), so that on a GPU generate compiles its decoding step once for the whole distillation. Greedy
    answers are the same either way up to rounding."""
    device = next(model.parameters()).device
    encoded = []
    for msgs in prompts:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        encoded.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids)[-prompt_tokens:])
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = [""] * len(prompts)
    settings = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    static = cache == "static"
    if static:
        settings["cache_implementation"] = "static"
    starts = range(0, len(order), batch)
    kept, path = {}, None
    if journal is not None:
        digest = _digest(encoded, batch, new_tokens, pad, temperature, seed, cache)
        path = journal / f"{desc.replace(' ', '_')}.{digest}.jsonl"
        kept = _read_journal(path)
        for lo, texts in kept.items():
            for i, text in zip(order[lo: lo + batch], texts):
                answers[i] = text
    start, produced = time.perf_counter(), 0
    bar = tqdm(starts, desc=desc, unit="batch", disable=not progress, initial=len(kept), total=len(starts))
    for lo in (lo for lo in starts if lo not in kept):
        bar.update(1)
        if temperature > 0:
            torch.manual_seed((seed * 1_000_003 + lo) % 2**63)
        chunk = order[lo: lo + batch]
        rows, t = (min(batch, len(order)), prompt_tokens) if static else \
            (len(chunk), max(len(encoded[i]) for i in chunk))
        ids = torch.full((rows, t), pad, dtype=torch.long)
        attn = torch.zeros((rows, t), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, t - len(encoded[i]):] = torch.tensor(encoded[i])
            attn[row, t - len(encoded[i]):] = 1
        ids[len(chunk):], attn[len(chunk):] = ids[len(chunk) - 1], attn[len(chunk) - 1]  # static: the filler rows
        gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=new_tokens,
                             pad_token_id=pad, **settings)[: len(chunk)]
        texts = [text.strip() for text in tokenizer.batch_decode(gen[:, t:], skip_special_tokens=True)]
        for i, text in zip(chunk, texts):
            answers[i] = text
        if path is not None:
            _append_journal(path, lo, texts)
        produced += int((gen[:, t:] != pad).sum())
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - start):.0f}")
    bar.close()
    return answers


def _digest(encoded: list[list[int]], batch: int, new_tokens: int, pad: int, temperature: float, seed: int,
            cache: str = "dynamic") -> str:
    """What a batch's answers depend on besides the model, as a short hex digest (a journal's name); the
    default cache adds nothing, so that a journal keeps its name."""
    what = [encoded, batch, new_tokens, pad, temperature, seed] + ([cache] if cache != "dynamic" else [])
    what = json.dumps(what, separators=(",", ":"))
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _read_journal(path: Path) -> dict[int, list[str]]:
    """The batches a journal holds, by their first position in the length order; a last line cut short by
    an interruption is left out (that batch is made again)."""
    kept = {}
    if path.is_file():
        data = path.read_bytes()
        if not data.endswith(b"\n"):  # cut short: drop the partial line, so that the next batch starts a line
            data = data[: data.rfind(b"\n") + 1]
            os.truncate(path, len(data))
        for line in data.decode("utf-8").split("\n"):  # (not splitlines: an answer may hold U+2028)
            if not line:
                continue
            try:
                entry = json.loads(line)
                kept[int(entry["batch"])] = list(entry["answers"])
            except (ValueError, KeyError, TypeError):
                continue
    return kept


def _append_journal(path: Path, lo: int, texts: list[str]) -> None:
    """Append one batch's answers as one line, flushed to the disk before the next batch starts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"batch": lo, "answers": texts}, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
