"""Small helpers of the start-up path: quiet platform probing (quiet.py), compile progress (progress.py), locks per key
(keyed_locks.py) and reading a --config file (config_file.py)."""
