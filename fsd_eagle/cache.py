"""Static KV caches with explicit write slots and accepted-path compaction.

Slots are cache rows; a committed prefix of length L occupies slots [0, L) with position = slot. A round
writes its n tree tokens to slots [L, L + n) (positions L + depth), then :func:`compact` moves the accepted
path to [L, L + a) so the prefix stays contiguous. Nothing is reallocated after ``allocate``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """A transformers ``Cache`` over one preallocated buffer ``[2, layers, 1, H_kv, S, D]`` (keys, values),
    seen by the model as a ``[1, H_kv, S, D]`` pair per layer; one buffer lets ``compact`` move every
    layer's rows in a single gather and scatter instead of two per layer.

    ``write_slots`` (a fixed ``[S]`` buffer: its first n entries are set in place before a forward of n
    tokens) says where ``update`` writes the new keys and values; attention always reads all S rows, the
    caller's mask hides the unused ones.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        # Cache.__init__ differs between transformers 5.x releases; we own every method the models call.
        self.layers = []
        self.max_len = max_len
        self.kv = torch.zeros((2, num_layers, 1, num_kv_heads, max_len, head_dim), dtype=dtype, device=device)
        self.keys = list(self.kv[0].unbind(0))
        self.values = list(self.kv[1].unbind(0))
        self.write_slots = torch.zeros(max_len, dtype=torch.long, device=device)

    def set_write_slots(self, slots: torch.Tensor) -> None:
        """Where the next forward's n = len(slots) tokens go (in place: a captured graph keeps the address)."""
        self.write_slots[: slots.shape[0]].copy_(slots)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.write_slots[: key_states.shape[2]]
        self.keys[layer_idx].index_copy_(2, slots, key_states)
        self.values[layer_idx].index_copy_(2, slots, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and masks are always passed explicitly

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.max_len, 0

    @property
    def is_compileable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.keys)

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows ``src`` to rows ``dst`` in every layer (gather first, so overlaps are safe)."""
        self.kv.index_copy_(4, dst, self.kv.index_select(4, src))


def attention_mask(prefix_len: torch.Tensor, slots: torch.Tensor, anc: torch.Tensor, max_len: int) -> torch.Tensor:
    """Boolean attention mask ``[n, S]`` for n query rows.

    Row i sees every committed slot (< prefix_len) and the slots ``slots[j]`` (``[m]``, after the prefix)
    where ``anc[i, j]`` (``[n, m]``): its ancestors and itself in a tree, the earlier rows of a chain.
    """
    n = anc.shape[0]
    cols = torch.arange(max_len, device=slots.device)
    mask = (cols < prefix_len).unsqueeze(0).expand(n, max_len).clone()
    mask.index_copy_(1, slots, anc)
    return mask


def key_positions(slots: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """Position of the token in each of the S slots once the new tokens are written (for sliding windows)."""
    pos = torch.arange(max_len, device=slots.device)
    return pos.index_copy(0, slots, positions)
