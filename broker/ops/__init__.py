"""Running the broker as a service: the live view (``broker status --watch``), the Prometheus exporter,
ACL rules, and the local redis-servers the tests, demos and benchmark start. The ``broker`` command that
reaches them is ``broker/cli.py``."""
