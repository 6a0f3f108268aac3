"""Static KV caches with explicit write slots and accepted-path compaction.

Slots are cache rows; a committed prefix of length L occupies slots [0, L) with position = slot. A round
writes its n tree tokens to slots [L, L + n) (positions L + depth), then :func:`compact` moves the accepted
path to [L, L + a) so the prefix stays contiguous. Nothing is reallocated after ``allocate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """A transformers ``Cache`` over one preallocated buffer ``[2, layers, 1, H_kv, S, D]`` (keys, values),
    seen by the model as a ``[1, H_kv, S, D]`` pair per layer; one buffer lets ``compact`` move every
    layer's rows in a single gather and scatter instead of two per layer.

    Compiled, a write indexes the whole buffer (``index_put_`` with an index tensor per dimension), never a
    per-layer view of it: inductor turns writes to views of a buffer that the same graph also changes whole
    (``compact``) into copies of the buffer (on an H100: two copies of the 47 MB cache per round, 62 us).
    Eagerly, two ``index_copy_`` on the views launch fewer kernels than that broadcast ``index_put_`` (the
    graph-only AR on an H100: 299.3 tokens/s with them at commit 1976c92, 278.6 with ``index_put_`` at b887f10).

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
        # Index tensors of a layer's write (keys and values of every head; slots come last): [2, 1, 1] each.
        zero = torch.zeros((1, 1, 1), dtype=torch.long, device=device)
        self._kv_index = torch.arange(2, device=device).view(2, 1, 1)
        self._layer_index = [zero + i for i in range(num_layers)]
        self._head_index = torch.arange(num_kv_heads, device=device).view(1, num_kv_heads, 1)
        self._zero = zero

    def set_write_slots(self, slots: torch.Tensor) -> None:
        """Where the next forward's n = len(slots) tokens go (in place: a captured graph keeps the address)."""
        self.write_slots[: slots.shape[0]].copy_(slots)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys and values ``[1, H_kv, n, D]`` to the n write slots; returns the layer's
        whole cache pair."""
        slots = self.write_slots[: key_states.shape[2]]
        if torch.compiler.is_compiling():
            index = (self._kv_index, self._layer_index[layer_idx], self._zero, self._head_index, slots.view(1, 1, -1))
            self.kv.index_put_(index, torch.stack((key_states[0], value_states[0])))
        else:
            self.keys[layer_idx].index_copy_(2, slots, key_states)
            self.values[layer_idx].index_copy_(2, slots, value_states)
        return self.kv[0, layer_idx], self.kv[1, layer_idx]

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


@dataclass(frozen=True)
class SlotMask:
    """What n query rows see in a cache of S slots: every committed slot (< ``prefix``, a 0-dim tensor) and,
    among the m slots after it, slot prefix + j where ``anc[i, j]`` (``[n, m]`` bool: its ancestors and
    itself in a tree, the earlier rows of a chain).

    For a sliding window (``windowed``): ``key_positions`` ``[m]`` are the positions of the tokens in those m
    slots (default: the rows' own positions, when the rows are those m tokens), a committed slot's token has
    position = slot, and row i at ``positions[i]`` sees keys less than ``window`` positions behind it.

    Structured rather than a dense ``[n, S]`` tensor so that FlexAttention gets its block lists by
    arithmetic on ``prefix`` instead of reductions and sorts over the dense mask.
    """

    prefix: torch.Tensor
    anc: torch.Tensor
    max_len: int
    key_positions: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    window: int | None = None

    def windowed(self, positions: torch.Tensor, window: int) -> "SlotMask":
        """This mask for rows at ``positions`` ``[n]`` under a sliding window."""
        keys = positions if self.key_positions is None else self.key_positions
        return SlotMask(self.prefix, self.anc, self.max_len, keys, positions, window)

    def dense(self, rows: int | None = None) -> torch.Tensor:
        """The mask as a boolean ``[rows, S]`` tensor (default rows: n; rows past n see the prefix only).

        Built by writing ``anc`` into the new slots' columns: a written buffer, which inductor keeps as a
        tensor for FlexAttention's mask lookup (its CPU kernel rejects the mask as inlined arithmetic)."""
        (n, m), dev = self.anc.shape, self.anc.device
        rows = rows or n
        anc = torch.cat([self.anc, self.anc.new_zeros(rows - n, m)]) if rows > n else self.anc
        cols = torch.arange(self.max_len, device=dev)
        new = self.prefix + torch.arange(m, device=dev)
        mask = (cols < self.prefix).expand(rows, self.max_len).clone()
        mask.index_copy_(1, new, anc)
        if self.window is None:
            return mask
        key_pos = cols.index_copy(0, new, self.key_positions)
        pos = torch.cat([self.positions, self.positions[-1:].expand(rows - n)]) if rows > n else self.positions
        return mask & (pos.unsqueeze(1) - key_pos.unsqueeze(0) < self.window)
