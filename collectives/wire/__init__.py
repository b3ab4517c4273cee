"""The wire: what every compressed exchange's bytes look like, in one place.

- ``frame.py``: one payload as a flat byte tensor (the self-describing, validated
  ``Payload.to_bytes`` format), a set of payloads as one frame (lengths, then payloads), and
  the exchange of byte tensors of different sizes;
- ``header.py``: the small header row every rank all-gathers before a self-describing
  exchange (one tensor, or a set of them), so a mismatch is an error on every rank;
- ``layouts.py``: agreed layouts, where payloads travel as raw tensors at places every rank
  derives (fixed-size :class:`Layout`, variable-size :class:`SizedLayout`);
- ``bounds.py``: variable-size payloads at an agreed capacity, sent as fixed-size ones;
- ``status.py``: the status word of an agreed exchange and the device-side checks of what it
  received (:class:`Flags`).
"""
