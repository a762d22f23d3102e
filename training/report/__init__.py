"""What a run shows its user: the console's lines (`console.py`), the training curves, samples from the export, the
end-of-run summary and the exported folder's model card."""
