"""The numpy floor (setup.py: numpy>=2.0) holds: `python .ci/numpy_floor.py VERSION` with
numpy VERSION first on the path (.ci/run: 2.0.0, or the first release with wheels for a
newer Python).

Every compressor compresses, sends through its wire format and decompresses on CPU, with
and without error feedback, in each float dtype, and the collectives run at world size 1
(the fused path included, for the one-round compressors): every numpy call of the CPU path runs at the floor version.
"""
import sys

import numpy as np
import torch

from gradcomp.collectives import allreduce, allreduce_fused
from gradcomp.compress import ErrorFeedback, Payload, available_compressors, get_compressor

WANT = sys.argv[1]
assert np.__version__ == WANT, f"numpy {np.__version__} is on the path, not the floor {WANT}"

torch.manual_seed(0)
for name in available_compressors():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for shape in ((4099,), (64, 48), (3, 5, 7)):
            t = torch.randn(shape, dtype=torch.float64).to(dtype)
            for codec in (get_compressor(name), ErrorFeedback(get_compressor(name))):
                for step in range(2):  # a second step uses the residual and per-key state
                    p = codec.compress(t, key="w")
                    q = Payload.from_bytes(p.to_bytes())
                    out = codec.decompress(q)
                    assert out.shape == t.shape and out.dtype == t.dtype, (name, dtype, shape)
            out = allreduce(t, compressor=get_compressor(name), key=f"{name}-{dtype}-{shape}")
            assert out.shape == t.shape and out.dtype == t.dtype, (name, dtype, shape)
    if get_compressor(name).multi_round:  # allreduce only (an instance's capability; the class's is a property)
        continue
    items = [(f"fused-{name}-{i}", torch.randn(257 * (i + 1)), get_compressor(name)) for i in range(3)]
    outs = allreduce_fused(items)
    assert [o.shape for o in outs] == [t.shape for _, t, _ in items], name
print(f"numpy {np.__version__}: {len(available_compressors())} compressors, wire format, "
      "allreduce and allreduce_fused run")
