"""Self-distillation: the target answers the training prompts itself (batched on the GPU), so the head learns
the target's own continuations rather than ShareGPT's answers: its greedy answer, or several answers sampled
at a temperature (more data, and the contexts that sampled decoding meets)."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .data import Conversation


@torch.no_grad()
def distill(model, tokenizer, convs: list[Conversation], batch: int, prompt_tokens: int, new_tokens: int,
            turns: int = 1, done: list[Conversation] = (), done_turns: int = 0, temperature: float = 0.0,
            samples: int = 1, seed: int = 0, progress: bool = True) -> list[Conversation]:
    """Regenerate the first ``turns`` assistant turns of each conversation, turn by turn: turn k answers the
    conversation's k-th user message after the target's own earlier answers (the original answers are
    dropped), so every assistant turn of a result is the target's. Returns new conversations (source
    'distill:<source>'); one stops at its first empty answer.

    ``temperature`` 0: the greedy answer. Above 0: ``samples`` answers per conversation, each its own
    dialogue sampled from the target's distribution at that temperature (no top-k / top-p), ids
    ``<id>`` for the first and ``<id>#<s>`` for the others; ``seed`` fixes the draws (the same settings
    give the same answers).

    ``done``: an earlier result of the same settings with ``done_turns`` turns, extended here from turn
    ``done_turns`` on (a conversation it ended, or left out, stays so). ``progress``: show progress bars."""
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
                          f"distill turn {k + 1}", temperature, (seed * 1000 + k) % 2**63, progress)
        alive = []
        for (i, c, msgs), answer in zip(jobs, answers):
            if answer:
                dialogs[i] = msgs + [{"role": "assistant", "content": answer}]
                alive.append((i, c))
    return [Conversation(i, c.index, f"distill:{c.source}", dialogs[i]) for i, c in copies if dialogs[i]]


def distill_shared(ranks, model, tokenizer, convs: list[Conversation], batch: int, prompt_tokens: int,
                   new_tokens: int, turns: int = 1, done: list[Conversation] = (), done_turns: int = 0,
                   temperature: float = 0.0, samples: int = 1, seed: int = 0) -> list[Conversation]:
    """``distill`` shared by data-parallel processes (training/ddp.py): process r answers conversations r,
    r + N, ... (sampled answers draw from a stream seeded per process), and every process gets all the
    answers, in the order one process would have made them. Alone: ``distill`` itself."""
    from .ddp import gather_objects

    if not ranks.parallel:
        return distill(model, tokenizer, convs, batch, prompt_tokens, new_tokens, turns, done, done_turns,
                       temperature, samples, seed)
    mine = distill(model, tokenizer, convs[ranks.rank::ranks.world], batch, prompt_tokens, new_tokens, turns, done,
                   done_turns, temperature, samples, seed + 7919 * ranks.rank, progress=ranks.is_main)
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
            desc: str, temperature: float = 0.0, seed: int = 0, progress: bool = True) -> list[str]:
    """The target's answer to each chat prompt (its last ``prompt_tokens`` tokens): greedy, or sampled at
    ``temperature`` (the random state seeded with ``seed`` first), in batches of similar lengths (less
    padding); answers in the order of ``prompts``."""
    device = next(model.parameters()).device
    encoded = []
    for msgs in prompts:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        encoded.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids)[-prompt_tokens:])
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = [""] * len(prompts)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    if temperature > 0:
        torch.manual_seed(seed)
    start, produced = time.perf_counter(), 0
    bar = tqdm(range(0, len(order), batch), desc=desc, unit="batch", disable=not progress)
    for lo in bar:
        chunk = order[lo: lo + batch]
        t = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), t), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), t), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, t - len(encoded[i]):] = torch.tensor(encoded[i])
            attn[row, t - len(encoded[i]):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=new_tokens,
                             pad_token_id=pad, **sampling)
        for i, text in zip(chunk, tokenizer.batch_decode(gen[:, t:], skip_special_tokens=True)):
            answers[i] = text.strip()
        produced += int((gen[:, t:] != pad).sum())
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - start):.0f}")
    return answers
