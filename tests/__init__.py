"""The test suite: tests/<package path>/test_<module>.py mirrors the package; shared helpers live in tests/support."""
