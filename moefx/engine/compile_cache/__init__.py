"""Compile work that outlives the process: the artifact file (`file.py`) and the saved traces in it (`aot.py`)."""
