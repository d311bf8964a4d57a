"""Small helpers of the start-up path: quiet platform probing (quiet.py) and compile progress (progress.py)."""
