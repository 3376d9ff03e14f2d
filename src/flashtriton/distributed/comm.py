"""Point-to-point transfers around a ring of ranks: each rank sends a tensor to the next rank and receives the
previous rank's into a new buffer, while it computes; or (``Ring.trade``) to and from ranks further away.

``Ring.shift`` posts the pair with ``batch_isend_irecv`` and returns at once; ``Pending.wait`` returns the received
tensor. On CUDA, NCCL runs the transfer on its own stream and ``wait`` makes the current stream wait for it (the host
does not block), so a step's kernels overlap the next step's transfer. Every rank posts its shifts in the same
order, which is how sends and receives between a pair of ranks are matched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Pending:
    """A posted shift: the tensor sent (kept alive until the transfer is done) and the buffer being received."""

    def __init__(self, works: list, sent: torch.Tensor | None, received: torch.Tensor | None):
        self._works, self._sent, self._received = works, sent, received

    def wait(self) -> torch.Tensor | None:
        for work in self._works:
            work.wait()
        self._sent = None
        return self._received


class Ring:
    """This rank's neighbours in a process group: it sends to rank + 1 and receives from rank - 1 (mod size)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = self.peer(1), self.peer(-1)

    def peer(self, distance: int) -> int:
        """The global rank of the group's rank ``distance`` after this one (mod size)."""
        rank = (self.rank + distance) % self.world
        return dist.get_global_rank(self.group, rank) if self.group else rank

    def shift(self, x: torch.Tensor) -> Pending:
        """Sends x to the next rank and receives the previous rank's tensor of the same shape and dtype."""
        received = torch.empty_like(x, memory_format=torch.contiguous_format)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return Pending(dist.batch_isend_irecv(ops), x, received)

    def trade(self, x: torch.Tensor | None, distance: int, shape: tuple | None, like: torch.Tensor) -> Pending:
        """Sends x (None: nothing) to the rank ``distance`` after this one and receives a tensor of ``shape`` (None:
        nothing) with like's dtype and device from the rank ``distance`` before it. Each pair of ranks agrees on what
        passes between them, so a send is posted exactly where its receive is."""
        received = None if shape is None else torch.empty(shape, dtype=like.dtype, device=like.device)
        ops = [] if x is None else [dist.P2POp(dist.isend, x, self.peer(distance), self.group)]
        if received is not None:
            ops.append(dist.P2POp(dist.irecv, received, self.peer(-distance), self.group))
        return Pending(dist.batch_isend_irecv(ops) if ops else [], x, received)
