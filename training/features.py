"""Examples (token ids + assistant mask) from conversations, batching, and the target's features."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from fsd_eagle.target import Target


@dataclass
class Example:
    ids: np.ndarray  # [T] int32
    mask: np.ndarray  # [T] bool: token belongs to an assistant turn


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> Example | None:
    """Apply the chat template turn by turn so each assistant turn's tokens are marked for the loss."""
    ids: list[int] = []
    mask: list[bool] = []
    for i, msg in enumerate(messages):
        full = template_ids(tokenizer, messages[: i + 1])
        new = full[len(ids):]
        ids = full
        mask.extend([msg["role"] == "assistant"] * len(new))
        if len(ids) >= max_len:
            break
    return make_example(ids, mask, max_len)


def make_example(ids: list[int], mask: list[bool], max_len: int) -> Example | None:
    """The first ``max_len`` tokens and their mask as an Example; None when no token after the first is
    marked (nothing to learn)."""
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask[1:]):
        return None
    return Example(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))


def rank_tokens(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """Every token id ``[V]``, most frequent first among the examples' answer tokens (what the head learns
    to draft), ties in id order: the head's token ranking, whose first entries are a draft vocabulary
    (TreeConfig.draft_vocab)."""
    answers = np.concatenate([e.ids[e.mask] for e in examples]) if examples else np.zeros(0, dtype=np.int32)
    counts = np.bincount(answers, minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(np.argsort(-counts, kind="stable"))


def template_ids(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (with the generation prompt if asked)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def make_batches(examples: list[Example], tokens_per_batch: int, seed: int) -> list[list[int]]:
    """Length-sorted buckets of example indices, each padded size <= tokens_per_batch; shuffled."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    batches, cur, longest = [], [], 0
    for i in order:
        n = len(examples[i].ids)
        if cur and max(longest, n) * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def collate(examples: list[Example], idx: list[int], device: torch.device):
    """Right-padded ids ``[B, T]``, attention ``[B, T]`` and loss mask ``[B, T]``."""
    t = max(len(examples[i].ids) for i in idx)
    ids = torch.zeros(len(idx), t, dtype=torch.long)
    attn = torch.zeros(len(idx), t, dtype=torch.bool)
    mask = torch.zeros(len(idx), t, dtype=torch.bool)
    for row, i in enumerate(idx):
        n = len(examples[i].ids)
        ids[row, :n] = torch.from_numpy(examples[i].ids.astype(np.int64))
        attn[row, :n] = True
        mask[row, :n] = torch.from_numpy(examples[i].mask)
    return ids.to(device), attn.to(device), mask.to(device)


@torch.no_grad()
def target_features(target: Target, ids: torch.Tensor, attn: torch.Tensor,
                    layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of the target: f ``[B, T, h]``, its last hidden state after the final norm (the lm_head
    input), and with ``layers`` (an eagle3 head's) the hidden states entering those decoder layers, side by
    side ``[B, T, m*h]`` (None without; hidden states are kept only then)."""
    out = target.base(input_ids=ids, attention_mask=attn.long(), **({"output_hidden_states": True} if layers else {}))
    states = torch.cat([out.hidden_states[i] for i in layers], -1) if layers else None
    return out.last_hidden_state, states
