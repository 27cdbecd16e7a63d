"""Workers of an RL run through the broker: GRPO, PPO or DAPO on a small tensor-parallel model, in Ray
worker groups that pass every sample through the dock.

The programs sit at the top: ``demo.py`` (``python -m workers.demo``, also ``broker demo``) with its options
(``options.py``, light enough for ``broker``'s parser), ``train_local.py`` (the same GRPO in one process, no
broker), and ``config.py``, what a run is made of. Below them, one concern per folder, each importing only
the ones above it in this list (and ``runtime/`` the config):

* ``model/``: the network, its tensor parallelism and the rank groups it runs in, and the task it learns;
* ``algorithms/``: what an algorithm is to the pipeline, the roles they share, GRPO, PPO and DAPO, and their
  formulas;
* ``runtime/``: Ray, the driver and the worker loop on the dock, and the run's record.
"""
