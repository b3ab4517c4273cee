"""``python -m gradcomp.bench``: the collective benchmark (every compressor against dense
``all_reduce`` on local gloo ranks, optionally over emulated links) and ``train``, the
training benchmark. See ``bench/RESULTS.md`` for measured figures."""
