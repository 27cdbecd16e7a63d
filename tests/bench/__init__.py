"""The benchmark's modes, run small."""
