"""What a caller touches: the dock as a facade (``dock.py`` and its verbs in ``dock_*.py``), the checks of what
it is handed, hand-outs and their deliveries, batches, DP balance, partial rollout and the dock's own call
metrics. Uses control/ and data/.
"""
