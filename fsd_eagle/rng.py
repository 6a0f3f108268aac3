"""Counter-based random numbers for sampling rounds that CUDA graphs and torch.compile can replay.

A draw is a pure function of (key, counter, draw, element index): the key comes from the call's seed, the
counter is a device tensor that every prefill and round advances by one in place, and ``draw`` (a small
constant) tells apart the draws of one step. A captured graph or a compiled round therefore reads its
random numbers from two tensors it holds by address, with no generator object, host state or host sync,
and the same seed gives the same numbers in eager, graph and compiled rounds, on every device and in
every process.

The mixing function is a 32-bit integer hash (lowbias32: xor-shifts and multiplications by odd constants, a
bijection with low bias), evaluated on int64 tensors whose values stay below 2^32; each multiplication is
split into 16-bit halves so that no intermediate overflows int64. Two mixing rounds per element, keyed by
two 32-bit words derived from (key, counter, draw), give the 24-bit uniforms a float32 holds exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_GOLDEN = 0x9E3779B9  # separates the words mixed into a step's keys


def _mul32(x: torch.Tensor | int, c: int):
    """(x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow (x split into 16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & _MASK32


def mix32(x):
    """lowbias32 of x (int64 tensor or int, values in [0, 2^32)): a bijection of 32-bit words."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


@dataclass
class RandomStream:
    """The random numbers of B rows, each a call of its own. key ``[B, 2]`` int64: two 32-bit words derived
    from the row's seed; counter ``[B]`` int64: the row's step (prefill 0, then one per round). Both are
    updated in place only, so that a captured graph that reads them stays valid across calls. A row's
    numbers depend on its key and step only: the same seed gives the same numbers whatever the batch."""

    key: torch.Tensor
    counter: torch.Tensor

    @classmethod
    def create(cls, device: torch.device | str, seed: int = 0, batch: int = 1) -> "RandomStream":
        stream = cls(torch.zeros(batch, 2, dtype=torch.long, device=device),
                     torch.zeros(batch, dtype=torch.long, device=device))
        stream.reseed(seed)
        return stream

    @staticmethod
    def key_words(seed: int) -> tuple[int, int]:
        """The two key words of ``seed`` (any Python int; it is taken modulo 2^64)."""
        seed %= 1 << 64
        lo, hi = mix32(seed & _MASK32), mix32((seed >> 32) ^ _GOLDEN)
        return lo, mix32(hi ^ lo)

    def reseed(self, seed: int, row: int | None = None) -> None:
        """Restart ``row`` (default: every row) at step 0 with the key of ``seed``."""
        lo, hi = self.key_words(seed)
        rows = slice(None) if row is None else row
        self.key[rows, 0].fill_(lo)  # fills: no host-to-device copy, which would wait for the device
        self.key[rows, 1].fill_(hi)
        self.counter[rows].zero_()

    def advance(self) -> None:
        """Next step of every row (in place: captured graphs advance the stream as they replay)."""
        self.counter.add_(1)

    def load_rows(self, rows: torch.Tensor, other: "RandomStream", src: torch.Tensor) -> None:
        """Rows ``rows`` (``[k]`` index tensor) take the keys and steps of ``other``'s rows ``src``."""
        self.key.index_copy_(0, rows, other.key.index_select(0, src))
        self.counter.index_copy_(0, rows, other.counter.index_select(0, src))

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """``key`` and ``counter`` with their batch dimension (0; see ``decode.mark_batch_dynamic``)."""
        return [(self.key, 0), (self.counter, 0)]

    def words(self, draw: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two 32-bit words (int64) that key draw ``draw`` at each row's step: ``[B]`` each, or ``[B, D]``
        for a ``[D]`` tensor of draw ids (one small kernel for several draws). ``bits`` mixes each element's
        index with them (``index_bits``), and so does a kernel that draws its own numbers
        (``fsd_eagle.kernels.pool_draw``)."""
        step, k0, k1 = self.counter & _MASK32, self.key[:, 0], self.key[:, 1]
        if isinstance(draw, torch.Tensor):
            step, k0, k1 = step.unsqueeze(1), k0.unsqueeze(1), k1.unsqueeze(1)
        w1 = mix32(k0 ^ _mul32(step, _GOLDEN) ^ draw)
        return w1, mix32(k1 ^ w1)

    def bits(self, shape: tuple[int, ...], draw: int) -> torch.Tensor:
        """Random 32-bit words ``[B, *shape]`` (int64 in [0, 2^32)) of draw ``draw`` at each row's step."""
        return index_bits(*self.words(draw), shape)

    def uniform(self, shape: tuple[int, ...], draw: int) -> torch.Tensor:
        """float32 uniforms in (0, 1) ``[B, *shape]``: 24 random bits, offset by half a step (never 0 or 1)."""
        return to_uniform(self.bits(shape, draw))


def index_bits(w1: torch.Tensor, w2: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``[B, *shape]`` random 32-bit words: element i of row b is mix32(mix32(i ^ w1[b]) ^ w2[b]), i its index
    in row-major order; w1, w2 ``[B]``: a draw's words (``RandomStream.words``)."""
    n = 1
    for s in shape:
        n *= s
    index = torch.arange(n, device=w1.device).reshape(shape)
    per_row = (-1,) + (1,) * len(shape)
    return mix32(mix32(index ^ w1.view(per_row)) ^ w2.view(per_row))


def to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) from random 32-bit words: their top 24 bits, offset by half a step (never 0
    or 1; every value is exact in float32)."""
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


# Draw ids of one step (the stream's counter tells the steps apart).
DRAW_TOKEN = 0  # the target's token after a prefill, or a round's bonus token
DRAW_ACCEPT = 1  # a round's acceptance tests, one uniform per (tree level, node)
DRAW_CHILDREN = 16  # sampled children: DRAW_CHILDREN + level, one uniform per (expanded node, draft token)
