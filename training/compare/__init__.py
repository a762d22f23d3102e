"""The parts of `recipes/compare.py`: launching, reading logs, reporting."""
