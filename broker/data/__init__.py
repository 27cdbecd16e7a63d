"""The data plane: one row's wire format (``codec.py``) and where row bytes live (``store.py``).
Never imports api/, adapters/ or ops/.
"""
