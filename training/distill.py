"""Self-distillation: the target answers the training prompts itself (greedy, batched on the GPU), so the
head learns the target's own continuations rather than ShareGPT's answers."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .data import Conversation


@torch.no_grad()
def distill(model, tokenizer, convs: list[Conversation], batch: int, prompt_tokens: int, new_tokens: int) -> list[Conversation]:
    """Regenerate the first assistant turn of each conversation; returns new conversations
    (source 'distill:<source>') with the prompt messages and the target's answer."""
    device = next(model.parameters()).device
    prompts = []
    for c in convs:
        first_user = next(i for i, m in enumerate(c.messages) if m["role"] == "user")
        msgs = c.messages[: first_user + 1]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[-prompt_tokens:]
        prompts.append((c, msgs, ids))
    prompts.sort(key=lambda x: len(x[2]))  # similar lengths per batch: less padding
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[Conversation] = []
    start, produced = time.perf_counter(), 0
    bar = tqdm(range(0, len(prompts), batch), desc="distill", unit="batch")
    for lo in bar:
        chunk = prompts[lo: lo + batch]
        t = max(len(p[2]) for p in chunk)
        ids = torch.full((len(chunk), t), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), t), dtype=torch.long)
        for row, (_, _, p) in enumerate(chunk):
            ids[row, t - len(p):] = torch.tensor(p)
            attn[row, t - len(p):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad)
        answers = tokenizer.batch_decode(gen[:, t:], skip_special_tokens=True)
        for (conv, msgs, _), answer in zip(chunk, answers):
            answer = answer.strip()
            if answer:
                out.append(Conversation(conv.id, conv.index, f"distill:{conv.source}",
                                        msgs + [{"role": "assistant", "content": answer}]))
        produced += int((gen[:, t:] != pad).sum())
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - start):.0f}")
    return out
