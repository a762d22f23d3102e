"""The checks of `recipes/doctor.py`: the report, the machine, one launch."""
