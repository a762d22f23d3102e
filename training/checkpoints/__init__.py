"""Checkpoints and exports: resumable checkpoints (`checkpoint.py`), their strategy-neutral form for a resume under
another strategy or world size (`portable.py`), and the full weights gathered for the export (`export.py`)."""
