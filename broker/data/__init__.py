"""The data plane: one row to bytes and back (``codec.py``, its header ``row_header.py``) and where row bytes
live (``store.py``'s interface: ``slot_store.py`` on one server, ``sharded_store.py`` over data shards).
Never imports api/, adapters/ or ops/.
"""
