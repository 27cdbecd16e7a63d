"""The run on Ray, through the dock: the driver (``pipeline.py``) places each role's ``dp x tp`` group
(``cluster.py``), every rank loops on the broker (``worker.py``) and sees it through its TP group
(``dispatch.py``), and ``report.py`` records what happened."""
