"""``python -m gradcomp.bench``: the collective benchmark (every compressor against dense
``all_reduce`` on local gloo ranks, optionally over emulated links) and ``train``, the
training benchmark. Measured figures: ``bench/RESULTS.md``, an index of one page per area
(``bench/results/*.md``)."""
