"""The control plane: every key name (``keys.py``), the dock's schema, and every atomic rule (the Lua scripts of
``lua/`` and their typed wrappers), plus what is read back from them (status) and the wake-ups of puts.
Never imports api/, adapters/ or ops/.
"""
