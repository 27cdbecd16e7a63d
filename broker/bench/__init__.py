"""``broker bench``: what moving one GRPO global batch costs through the broker, and through what it replaces.

One synthetic batch (``workload.py``: 256 prompts × 8 samples, prompts 64-512 int32 tokens,
responses 64-2048, float32 log-probs and advantages per response token, scalar lengths and
scores) goes through six stages, each reading 128 rows (16 whole groups) per call except the
advantage stage, which reads the whole batch at once. Every stage's output is a pure function
of what it read, so equal checksums prove the data arrived intact. Systems measured in one run:

``broker``        this package's TransferDock, through its public API only (``broker_dock.py``)
``ray``           MindSpeed-RL's single-actor dock: one Ray actor, ``max_concurrency=100``, lists of
                  tensors, int32 status tensors, sampling by scanning, padded batches
                  (``mindspeed.py``, ``ray_dock.py``)
``redis-floor``   the same bytes through one pipelined HSET / HMGET per column and call, raw
                  tensor bytes, status in the benchmark process (``redis_floor.py``)
``inprocess``     a plain dict of lists, no copies: the workload's own cost (``inprocess.py``)

Modes (all four by default; naming any runs only those):

``--pipeline``    the sequential pipeline through every system in ``--systems``; ``--repeat`` timed
                  passes (best and median reported) after ``--warmup`` untimed ones, interleaved
``--concurrent``  every stage at once, ``--per-stage`` processes each, pipelined through the broker
``--sampling``    p50/p99 of one ``get_experience`` on docks of ``--sampling-sizes`` rows × 16 columns
``--memory``      Redis ``used_memory`` per payload byte with the whole batch stored (broker, floor)
``--soak``        instead of the modes: ``--clients`` processes putting and consuming on one dock for
                  ``--seconds``; ``--leases`` takes rows with leases and acks them, ``--kill`` (implies
                  ``--leases``) SIGKILLs a random client every ``--kill-every`` seconds on average;
                  then checks nothing was lost, handed out twice (without leases) or corrupted
``--cluster``     instead of the modes: the pipeline through the broker with one client on a private
                  redis-server and on a private ``--primaries``-primary Redis Cluster, in one run: the time
                  ratio, the checksums, server seconds per GB moved per primary (``INFO commandstats``, and
                  ``INFO cpu``) and the throughput they project for more primaries (``cluster.py``)

Other options: ``--url`` (default: a private ``redis-server`` started on a free port, which the
run says on stderr; ``--unix`` puts it on a unix socket; a URL naming any node of a Redis Cluster
measures the cluster: the broker's dock spreads its bytes over a data shard per primary, and memory,
keys and server time are summed over the primaries), ``--prompts`` (256), ``--n`` (8),
``--seed`` (0), ``--groups-per-call`` (16), ``--json`` (print only the JSON line),
``--lease-seconds`` (5). On a user's Redis the benchmark writes only keys named ``td:{bench-*}``
and ``bench:{bench-*}`` and deletes them afterwards. The exit status is 1 when checksums differ
or the soak's accounting fails, else 0; missed performance targets are reported, not failed.
"""
