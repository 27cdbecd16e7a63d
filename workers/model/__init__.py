"""The network and what it learns: a tensor-parallel transformer (``transformer.py`` on
``tensor_parallel.py``), the process groups of a role's ``dp x tp`` ranks (``parallel_state.py``), and the
digit-reversal task (``task.py``)."""
