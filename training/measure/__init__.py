"""The measuring tools behind recipes/measure/ and the tests that hold the planners to what a run really does: a
step on synthetic data (`synthetic.py`), the bytes a rank holds (`ledger.py`, `saved.py`), the pipeline's bubble and
memory (`bubble.py`), tensor and sequence parallelism's activations (`tensor_memory.py`, `ulysses.py`), and the
measured model states beside the planner (`measured.py`). Above the core and the planners: nothing below imports
them."""
