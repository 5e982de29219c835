"""The language-neutral conformance vectors (tests/conformance/vectors) run against the core."""
