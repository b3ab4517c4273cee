"""The link model every layer shares: one :class:`Link` and one rate parser.

A link is the alpha-beta model of a network path: ``alpha_ms`` of latency per message and
``rate`` bytes per millisecond that one rank sends. ``compressor="auto"`` measures one (or is
given one, ``link=``) and predicts exchanges on it; the benchmark's emulated cluster
(``gradcomp.bench.netem``) shapes every rank's link to one (its ``alpha_ms`` is the delay each
message takes one way). Text such as ``"1gbit"`` or ``"100mbit,5ms"`` is parsed here only
(:func:`parse_rate`, :meth:`Link.parse`), with one table of units.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Link", "parse_rate", "describe_rate", "RATE_UNITS"]

#: bits per second of each rate unit (decimal, as ``tc`` reads them)
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
_RATE = re.compile(r"([0-9]*\.?[0-9]+)(" + "|".join(RATE_UNITS) + r")")
_DELAY = re.compile(r"([0-9]*\.?[0-9]+)(us|ms|s)")


def parse_rate(text: str, what: str = "rate") -> int:
    """``"1gbit"``, ``"2.5Gbit"``, ``"100mbit"`` -> bits per second (an int); ``ValueError``
    (starting with ``what``, the caller's argument) if malformed."""
    m = _RATE.fullmatch(str(text).strip().lower())
    if m is None:
        raise ValueError(f"{what} {text!r} is not a rate; RATE is a number with unit {'/'.join(RATE_UNITS)} "
                         f"(e.g. 1gbit, 10gbit, 100mbit)")
    return int(float(m.group(1)) * RATE_UNITS[m.group(2)])


def describe_rate(bits: float) -> str:
    """``10**9`` -> ``"1 Gbit/s"``: the largest unit the rate reaches."""
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


@dataclass(frozen=True)
class Link:
    """A link model: ``alpha_ms`` per message (a small allreduce; for an emulated link, the
    delay of each message one way) and ``rate`` bytes per ms that one rank sends."""

    alpha_ms: float
    rate: float  # bytes per millisecond

    def ms(self, sent_bytes: float, messages: int) -> float:
        """Milliseconds to send ``sent_bytes`` in ``messages`` messages."""
        return messages * self.alpha_ms + sent_bytes / self.rate

    @property
    def rate_bit(self) -> int:
        """The rate in bits per second."""
        return round(self.rate * 8e3)

    @classmethod
    def of(cls, alpha_ms: float, gbit: float) -> "Link":
        """A link of ``gbit`` Gbit/s with ``alpha_ms`` per message."""
        return cls(float(alpha_ms), gbit * 1e9 / 8 / 1e3)

    @classmethod
    def parse(cls, text: str, what: str = "link") -> "Link":
        """``"1gbit"`` or ``"100mbit,5ms"`` (RATE[,DELAY]) as a :class:`Link`; ``ValueError``
        (starting with ``what``) if malformed."""
        parts = [p.strip().lower() for p in str(text).split(",")]
        try:
            bits = parse_rate(parts[0], what) if len(parts) <= 2 else None
        except ValueError:
            bits = None
        if bits is None:
            raise ValueError(f"{what} {text!r} is not RATE[,DELAY]; RATE is a number with unit "
                             f"{'/'.join(RATE_UNITS)} (e.g. 1gbit), DELAY a number with unit us/ms/s (e.g. 5ms)")
        delay = 0.0
        if len(parts) == 2:
            d = _DELAY.fullmatch(parts[1])
            if d is None:
                raise ValueError(f"{what} delay {parts[1]!r} must be a number with unit us, ms or s (e.g. 5ms)")
            delay = float(d.group(1)) * _DELAY_UNITS[d.group(2)]
        return cls(delay, bits / 8 / 1e3)

    def __str__(self) -> str:
        return describe_rate(self.rate_bit) + (f", {self.alpha_ms:g} ms delay" if self.alpha_ms else "")
