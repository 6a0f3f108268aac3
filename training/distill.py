"""Self-distillation: the target answers the training prompts itself (greedy, batched on the GPU), so the
head learns the target's own continuations rather than ShareGPT's answers."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .data import Conversation


@torch.no_grad()
def distill(model, tokenizer, convs: list[Conversation], batch: int, prompt_tokens: int, new_tokens: int,
            turns: int = 1, done: list[Conversation] = (), done_turns: int = 0) -> list[Conversation]:
    """Regenerate the first ``turns`` assistant turns of each conversation, turn by turn: turn k answers the
    conversation's k-th user message after the target's own earlier answers (the original answers are
    dropped), so every assistant turn of a result is the target's. Returns new conversations (source
    'distill:<source>'); one stops at its first empty answer.

    ``done``: an earlier result of the same settings with ``done_turns`` turns, extended here from turn
    ``done_turns`` on (a conversation it ended, or left out, stays so)."""
    made = {c.id: c.messages for c in done}
    dialogs = {c.id: list(made.get(c.id, [])) for c in convs}  # the regenerated conversation so far
    alive = [c for c in convs if sum(m["role"] == "assistant" for m in dialogs[c.id]) == done_turns]
    for k in range(done_turns, turns):
        jobs = []
        for c in alive:
            msgs = _turn_prompt(c.messages, k)
            if msgs is not None:
                jobs.append((c, dialogs[c.id] + msgs))
        answers = _answer(model, tokenizer, [m for _, m in jobs], batch, prompt_tokens, new_tokens, f"distill turn {k + 1}")
        alive = []
        for (c, msgs), answer in zip(jobs, answers):
            if answer:
                dialogs[c.id] = msgs + [{"role": "assistant", "content": answer}]
                alive.append(c)
    return [Conversation(c.id, c.index, f"distill:{c.source}", dialogs[c.id]) for c in convs if dialogs[c.id]]


def _turn_prompt(messages: list[dict], k: int) -> list[dict] | None:
    """The messages that open turn k (0-based): those after the (k-1)-th user message's answer, up to and
    including the k-th user message, without the original assistant answers; None if there is no k-th."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if k >= len(users):
        return None
    start = users[k - 1] + 1 if k else 0
    return [m for m in messages[start: users[k] + 1] if m["role"] != "assistant"]


def _answer(model, tokenizer, prompts: list[list[dict]], batch: int, prompt_tokens: int, new_tokens: int,
            desc: str) -> list[str]:
    """The target's greedy answer to each chat prompt (its last ``prompt_tokens`` tokens), in batches of
    similar lengths (less padding); answers in the order of ``prompts``."""
    device = next(model.parameters()).device
    encoded = []
    for msgs in prompts:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        encoded.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids)[-prompt_tokens:])
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = [""] * len(prompts)
    start, produced = time.perf_counter(), 0
    bar = tqdm(range(0, len(order), batch), desc=desc, unit="batch")
    for lo in bar:
        chunk = order[lo: lo + batch]
        t = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), t), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), t), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, t - len(encoded[i]):] = torch.tensor(encoded[i])
            attn[row, t - len(encoded[i]):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad)
        for i, text in zip(chunk, tokenizer.batch_decode(gen[:, t:], skip_special_tokens=True)):
            answers[i] = text.strip()
        produced += int((gen[:, t:] != pad).sum())
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - start):.0f}")
    return answers
