"""Workers of the GRPO run: the tensor-parallel policy model, the synthetic task, the RL math, and the Ray
worker groups that pass every sample through the broker (``python -m workers.demo``, also ``broker demo``)."""
