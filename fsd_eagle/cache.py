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
    """A transformers ``Cache`` over one preallocated buffer ``[2, layers, B, H_kv, S, D]`` (keys, values) for
    B rows (prompts decoded together), seen by the model as a ``[B, H_kv, S, D]`` pair per layer; one buffer
    lets ``compact`` move every layer's rows in a single gather and scatter instead of two per layer.

    Compiled, a write indexes the whole buffer (``index_put_`` with an index tensor per dimension), never a
    per-layer view of it: inductor turns writes to views of a buffer that the same graph also changes whole
    (``compact``) into copies of the buffer (on an H100: two copies of the 47 MB cache per round, 62 us).
    Eagerly, a ``scatter_`` per view launches fewer kernels than that broadcast ``index_put_``.

    ``write_slots`` (a fixed ``[B, S]`` buffer: its first n columns are set in place before a forward of n
    tokens per row) says where ``update`` writes each row's new keys and values; attention always reads all
    S slots, the caller's mask hides the unused ones.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, batch: int = 1) -> None:
        # Cache.__init__ differs between transformers 5.x releases; we own every method the models call.
        self.layers = []
        self.max_len, self.batch = max_len, batch
        self.kv = torch.zeros((2, num_layers, batch, num_kv_heads, max_len, head_dim), dtype=dtype, device=device)
        self.keys = list(self.kv[0].unbind(0))
        self.values = list(self.kv[1].unbind(0))
        self.write_slots = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        # Index tensors of a layer's write (keys and values, every row and head; slots come last). The row
        # index is a tensor of its own, not a view: a compiled round would take a view's base as one more
        # input with a batch dimension.
        self._kv_index = torch.arange(2, device=device).view(2, 1, 1, 1)
        self._layer_index = [torch.full((1, 1, 1, 1), i, dtype=torch.long, device=device) for i in range(num_layers)]
        self._row_index = torch.arange(batch, device=device).view(1, batch, 1, 1).clone()
        self._head_index = torch.arange(num_kv_heads, device=device).view(1, 1, num_kv_heads, 1)
        self._layers = torch.arange(num_layers, device=device)

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """This cache's tensors with a batch dimension, each with that dimension's index (see
        ``decode.mark_batch_dynamic``): ``kv`` (2), its per-layer views ``keys`` and ``values``
        ``[B, H_kv, S, D]`` (0), ``write_slots`` (0) and the row index ``[1, B, 1, 1]`` (1)."""
        views = [(t, 0) for t in self.keys + self.values]
        return [(self.kv, 2), (self.write_slots, 0), (self._row_index, 1)] + views

    def set_write_slots(self, slots: torch.Tensor) -> None:
        """Where the next forward's n tokens of each row go, ``[B, n]`` (in place: a captured graph keeps the
        address)."""
        self.write_slots[:, : slots.shape[1]].copy_(slots)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys and values ``[B, H_kv, n, D]`` to each row's n write slots; returns the
        layer's whole cache pair ``[B, H_kv, S, D]``."""
        b, h, n, d = key_states.shape
        slots = self.write_slots[:, :n]
        if torch.compiler.is_compiling():
            index = (self._kv_index, self._layer_index[layer_idx], self._row_index, self._head_index,
                     slots.view(1, b, 1, n))
            self.kv.index_put_(index, torch.stack((key_states, value_states)))
        else:
            where = slots.view(b, 1, n, 1).expand(b, h, n, d)
            self.keys[layer_idx].scatter_(2, where, key_states)
            self.values[layer_idx].scatter_(2, where, value_states)
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
        """Copy each row's slots ``src`` ``[B, P]`` to its slots ``dst`` ``[B, P]`` in every layer (gather
        first, so overlaps are safe). Indexing the whole buffer with an index tensor per dimension, not
        ``gather``/``scatter_``: inductor lowers a ``scatter_`` into a buffer as two copies of all of it."""
        b, p = src.shape
        where = (self._kv_index.view(2, 1, 1, 1, 1), self._layers.view(1, -1, 1, 1, 1),
                 self._row_index.view(1, 1, b, 1, 1), self._head_index.view(1, 1, 1, -1, 1))
        self.kv.index_put_(where + (dst.view(1, 1, b, 1, p),), self.kv[where + (src.view(1, 1, b, 1, p),)])

    def load_rows(self, rows: torch.Tensor, other: "SlotCache", src: torch.Tensor) -> None:
        """Rows ``rows`` (a ``[k]`` index tensor) take every slot of ``other``'s rows ``src`` (``[k]``; same
        number of slots)."""
        self.kv.index_copy_(2, rows, other.kv.index_select(2, src))


@dataclass(frozen=True)
class SlotMask:
    """What n query rows of each of B batch rows see in a cache of S slots: every committed slot (<
    ``prefix[b]``, ``[B]``) and, among the m slots after it, slot prefix + j where ``anc[b, i, j]`` (``[B, n,
    m]`` bool: its ancestors and itself in a tree, the earlier rows of a chain).

    For a sliding window (``windowed``): ``key_positions`` ``[B, m]`` are the positions of the tokens in those
    m slots (default: the rows' own positions, when the rows are those m tokens), a committed slot's token
    has position = slot, and row i at ``positions[b, i]`` sees keys less than ``window`` positions behind it.

    Structured rather than a dense ``[B, n, S]`` tensor so that FlexAttention gets its block lists by
    arithmetic on ``prefix`` instead of reductions and sorts over the dense mask.
    """

    prefix: torch.Tensor
    anc: torch.Tensor
    max_len: int
    key_positions: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    window: int | None = None

    def windowed(self, positions: torch.Tensor, window: int) -> "SlotMask":
        """This mask for rows at ``positions`` ``[B, n]`` under a sliding window."""
        keys = positions if self.key_positions is None else self.key_positions
        return SlotMask(self.prefix, self.anc, self.max_len, keys, positions, window)

    def dense(self, rows: int | None = None) -> torch.Tensor:
        """The mask as a boolean ``[B, rows, S]`` tensor (default rows: n; rows past n see the prefix only).

        Built by writing ``anc`` into the new slots' columns: a written buffer, which inductor keeps as a
        tensor for FlexAttention's mask lookup (its CPU kernel rejects the mask as inlined arithmetic)."""
        (b, n, m), dev = self.anc.shape, self.anc.device
        rows = rows or n
        anc = torch.cat([self.anc, self.anc.new_zeros(b, rows - n, m)], 1) if rows > n else self.anc
        cols = torch.arange(self.max_len, device=dev)
        new = self.prefix.unsqueeze(1) + torch.arange(m, device=dev)  # [B, m]
        mask = (cols < self.prefix.unsqueeze(1)).unsqueeze(1).expand(b, rows, self.max_len).clone()
        mask.scatter_(2, new.unsqueeze(1).expand(b, rows, m), anc)
        if self.window is None:
            return mask
        key_pos = cols.expand(b, self.max_len).scatter(1, new, self.key_positions)
        pos = self.positions
        if rows > n:
            pos = torch.cat([pos, pos[:, -1:].expand(b, rows - n)], 1)
        return mask & (pos.unsqueeze(2) - key_pos.unsqueeze(1) < self.window)
