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
``--tenants``     instead of the modes: the soak of one ACL tenant alone and beside a hostile one on the
                  same Redis 7 (long scripts, oversized writes, garbage meta, stray keys; an exporter
                  scraped throughout): its calls/s and p99 side by side, its accounting, every scrape
                  answered; ``--rounds`` alternated, ``--hostile-pause`` between misbehaviours (``tenants.py``)
``--cluster``     instead of the modes: the pipeline through the broker with one client on a private
                  redis-server and on a private ``--primaries``-primary Redis Cluster, in one run: the time
                  ratio, the checksums, server seconds per GB moved per primary (``INFO commandstats``, and
                  ``INFO cpu``) and the throughput they project for more primaries (``cluster.py``);
                  ``--partitions P`` makes the cluster's dock a partitioned one and projects with P = S

``--large``       only when named: TransferQueue's published benchmark (``perftest.py`` in the
                  ``transferqueue`` 0.1.11 wheel): a writer process puts one batch of ``--fields``
                  float32 columns of ``--batch`` x ``--seq-len`` (default 1024 x 10 x 8192 = 0.3125 GiB),
                  a reader process gets all of it, each call timed from the driver; ``--complex`` adds
                  its complex variant (a third of the columns ragged, a third strings),
                  ``--large-sizes 64,256,1024,4096`` sweeps the batch size. Systems (``--large-systems``):
                  ``broker`` (``put_experience`` / ``read_rows``, stacked where ``read_rows`` can),
                  ``redis-floor`` (one HSET / HMGET per column framed by hand around views of the
                  arrays, ``resp.py``) and ``transferqueue`` (SimpleStorage through ``kv_batch_put`` /
                  ``kv_batch_get``, in the interpreter of ``--tq-python``, by default this one when it
                  imports ``transfer_queue``: ``pip install 'redis-transfer-dock[tq]'``); ``--repeat``
                  passes after ``--warmup``, alternated; best, median and each system's first put;
                  ``used_memory`` per payload byte with the batch stored; the server's build, allocator
                  and ``io-threads`` (``large.py``, ``large_run.py``, ``large_tq.py``)
``--tq-perftest`` only when named: TransferQueue's ``perftest.py`` itself, from the wheel, run as it is
                  and through ``broker.transfer_queue`` with only the package name changed (Ray actors,
                  the drop-in's embedded redis-server), beside the native put and get on the same batch
                  shape; its put and get times, the actors' and the servers' CPU seconds, the embedded
                  server's ``used_memory`` per payload byte; skipped, saying why, without the wheel
                  (``tq_perftest.py``, ``tq_perftest_launch.py``)

Other options: ``--url`` (default: a private ``redis-server`` started on a free port, which the
run says on stderr; ``--unix`` puts it on a unix socket; a URL naming any node of a Redis Cluster
measures the cluster: the broker's dock spreads its bytes over a data shard per primary, and memory,
keys and server time are summed over the primaries), ``--prompts`` (256), ``--n`` (8),
``--seed`` (0), ``--groups-per-call`` (16), ``--json`` (print only the JSON line),
``--lease-seconds`` (5). On a user's Redis the benchmark writes only keys named ``td:{bench-*}``
and ``bench:{bench-*}`` and deletes them afterwards. The exit status is 1 when checksums differ
or the soak's accounting fails, else 0; missed performance targets are reported, not failed.
"""
