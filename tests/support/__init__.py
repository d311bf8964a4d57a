"""Helpers shared by the tests (imported as `tests.support.<module>`): launched servers, HF model directories,
PEFT adapters; and REPO_ROOT, the repository root that tests run scripts and read docs from."""

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
