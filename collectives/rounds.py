"""``rounds``: drive a multi-round compressor (PowerSGD: allreduce P, orthonormalise,
allreduce Q) through its ``rounds()`` generator.

Every tensor it yields is averaged over the group (``Comm.mean_``: averaged, never summed) and sent back; its return value is the result, which is
what error feedback keeps the difference to. Per-key state such as PowerSGD's warm start
lives in the compressor. After each local step the ranks exchange a three-number status
(next size, finished, failed), so a failure or a disagreement on one rank raises everywhere.
"""
from __future__ import annotations

from ._algorithm import Algorithm, Cost, fresh, register_algorithm, ring


@register_algorithm
class Rounds(Algorithm):
    name = "rounds"
    code = 4
    order = 0
    needs = "multi_round"
    rounds = 2  # PowerSGD's: P, then Q (the compressors' theoretical payload counts both)

    @classmethod
    def wire(cls, payload, world, rounds=None):
        """A ring allreduce per round (``rounds``, default :attr:`rounds`), ``payload`` bytes
        over all of them."""
        return Cost(ring(world) * payload, cls.rounds if rounds is None else int(rounds))

    def local(self, acc, dtype):
        self.acc = acc  # in fp32 under error feedback: the factors are computed in fp32 anyway
        self.gen = self.comp.rounds(acc, self.key)
        self.result = None
        self._step(None)
        if self.error is not None:
            raise self.error
        return 0, [self._size()]

    def run(self, table):
        comm, w = self.comm, self.comm.size
        while self.y is not None:
            y = fresh(self.y.contiguous(), self.acc)
            self.payload_bytes += y.numel() * y.element_size()
            comm.mean_(y)
            with self.rec.timing("compress"):
                self._step(y)
            status = comm.exchange([self._size(), int(self.error is not None)])
            failed = [r for r in range(w) if status[r, 1]]
            if failed:
                if self.error is not None:
                    raise self.error
                raise ValueError(f"allreduce: the multi-round compressor {self.comp.name} failed on rank(s) "
                                 f"{failed} between rounds (the error is raised there)")
            if len(set(status[:, 0].tolist())) > 1:
                raise ValueError(f"allreduce: ranks disagree on the next round of {self.comp.name} (sizes "
                                 f"{status[:, 0].tolist()}, -1 = finished); its rounds must depend only on the shape")
        return self.result, self.result

    def _step(self, average):
        """Advance the generator by one local step; remember the next tensor, result or error."""
        self.y, self.error = None, None
        try:
            self.y = next(self.gen) if average is None else self.gen.send(average)
        except StopIteration as stop:
            self.result = stop.value
        except Exception as exc:
            self.error = exc

    def _size(self) -> int:
        return -1 if self.y is None else self.y.numel()
