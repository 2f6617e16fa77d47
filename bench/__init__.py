"""draftfleet's benchmarks: ``python -m bench`` runs them all and writes ``BENCHMARKS.md``.

Each module measures one thing against a reference taken in the same run, on the same machine:
``saturation`` (a GPU worker against a bare client on one emulated SGLang server), ``overhead``
(Redis and Celery per task against a plain redis-py loop), ``inventory`` (the store against the
seed's loop and ``cat``), ``retokenize`` (batched against one answer at a time) and ``enqueue``
(against a pipelined push of the same bytes). ``report`` renders the results.
"""
