"""TransferQueue's (``transferqueue`` 0.1.11) public API on the broker: swap the package name, keep the code."""
