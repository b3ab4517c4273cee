"""kernels/_cupy.py: compiled modules are cached per device, not per compute capability (a module
loaded on one GPU cannot launch on another of the same capability: issue 22, item 9). CuPy is
replaced by a recorder, so this runs without a GPU."""

from gradcomp.kernels import _cupy

class _FakeCupy:
    def __init__(self):
        self.current = 0
        self.loaded = []  # (module number, device current when its function was fetched)
        fake = self

        class RawModule:
            def __init__(self, path):
                self.n = len(fake.loaded)
                fake.loaded.append([self.n, None])

            def get_function(self, name):
                fake.loaded[self.n][1] = fake.current
                return (self.n, name)

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                self.before, fake.current = fake.current, self.index

            def __exit__(self, *exc):
                fake.current = self.before

        self.RawModule = RawModule
        self.cuda = type("cuda", (), {"Device": Device})

def test_two_devices_of_one_capability_get_a_module_each(monkeypatch, tmp_path):
    fake = _FakeCupy()
    monkeypatch.setattr(_cupy, "_cupy", lambda: fake)
    monkeypatch.setattr(_cupy, "binary", lambda family, capability: tmp_path / f"{family}-{capability}.cubin")
    _cupy._kernel.cache_clear()
    _cupy.module.cache_clear()
    try:
        k0 = _cupy._kernel("sign", "pack", 90, 0)
        k1 = _cupy._kernel("sign", "pack", 90, 1)
        again = _cupy._kernel("sign", "pack", 90, 1)
    finally:
        _cupy._kernel.cache_clear()
        _cupy.module.cache_clear()
    assert k0 != k1 and again == k1
    assert fake.loaded == [[0, 0], [1, 1]]  # each module's function fetched with its own device current
