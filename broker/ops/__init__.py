"""Running the broker as a service: the live view (``broker status --watch``), the Prometheus exporter,
ACL rules, and the local redis-servers the tests, demos and benchmark start; for the tools that work beside
the docks on their server (the benchmark), the client a URL's docks share (``clients``) and docks' key names
(``keys``). The ``broker`` command that reaches them is ``broker/cli.py``."""
