"""The benchmark: time and memory of every variant on every backend, beside its peers.

``run`` (the ``bench`` command and the report writer), ``config`` (the schema), ``sweep`` (the
loop over points), ``cell`` (one cell's record), ``impls`` (zoo backends and peers on one point),
``measure`` (clocks, memory, the reference check), ``report`` (derived figures), ``markdown`` and
``plots`` (bench.md and its PNGs), ``merge`` (``bench-report``: pieces into one report) and
``auto_table`` (the table behind ``backend="auto"``). It borrows the harness's config loader and
device name (eval.harness.config, eval.harness.distributed); the harness imports nothing from here.
"""
