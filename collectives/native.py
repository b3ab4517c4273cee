"""``native``: allreduce the compressed representation itself.

For compressors that declare ``native`` (fp16, bf16, shared-seed random-k): ``tensors[0]`` of
every rank's payload is averaged by the backend's allreduce (``Comm.mean_``: the one rule,
scaled before the sum as PyTorch does);
everything else in the payload (metadata, index tensors) must be the same on every rank. The
header compares a hash of the metadata on every call (``verify=True`` hashes the index tensors
too), so ranks whose seeds or steps drifted apart get an error, not a wrong average.

"""
from __future__ import annotations

import hashlib
import json
import math

import torch

from gradcomp.compress import Payload
from gradcomp.kernels.memory import empty

from ._algorithm import Algorithm, Cost, as_dtype, fresh, register_algorithm, ring, shares_memory


@register_algorithm
class Native(Algorithm):
    name = "native"
    code = 1
    order = 1
    needs = "native"

    @classmethod
    def wire(cls, payload, world):
        """One ring allreduce of the payload (a dense bucket's too: its payload is itself)."""
        return Cost(ring(world) * payload, 1)

    def local(self, acc, dtype):
        src = as_dtype(acc, dtype)
        if self.want_sent:
            payload, sent = self.comp.compress_decoded(src, self.key)
        else:  # the identity's payload is then the input itself, averaged into a copy below
            payload, sent = self.comp.compress_view(src, self.key), None
        if not payload.tensors or not payload.tensors[0].is_floating_point():
            raise ValueError(f"{self.comp.name} declares native=True but its first payload tensor is not floating point")
        summed = payload.tensors[0]
        # a payload that is the input (the identity's) is averaged into a copy, made by the
        # scaling's own pass (Comm.mean); summed is then never written, and sent needs no copy
        self.shared = shares_memory(summed, acc, src)
        self.sent = sent if sent is None or self.shared else fresh(sent, summed)
        self.payload = payload
        self.summed = summed
        self.payload_bytes = payload.nbytes
        return _check_hash(payload, self.verify), []

    def run(self, table):
        summed = self.comm.mean(self.summed) if self.shared else self.comm.mean_(self.summed)
        p = self.payload
        with self.rec.timing("decompress"):
            averaged = Payload(p.compressor, p.shape, p.dtype, [summed, *p.tensors[1:]], p.meta)
            avg = self.comp.decoding_of(averaged)  # the identity's: the averaged tensor itself
            if avg is None:
                # decoded into a numpy-backed buffer: no page-fault cost for a large tensor on CPU
                avg = empty(math.prod(p.shape), p.dtype, summed.device).view(p.shape)
                self.comp.decompress_into(averaged, avg, accumulate=False)
        return avg, self.sent


def _check_hash(payload: Payload, with_tensors: bool) -> int:
    """Hash of what must be identical across ranks: metadata, tensor specs (and, on request,
    the tensors after the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(payload.meta, sort_keys=True, default=str).encode())
    h.update(repr([(str(t.dtype), tuple(t.shape)) for t in payload.tensors]).encode())
    if with_tensors:
        for t in payload.tensors[1:]:
            h.update(t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)
