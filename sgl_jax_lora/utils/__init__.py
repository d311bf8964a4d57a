"""Small helpers of the start-up path: quiet platform probing (quiet.py), compile progress (progress.py), locks per key
(keyed_locks.py), reading a --config file (config_file.py) and text as errors quote it (shown_text.py)."""
