"""Tools for tests, examples and benchmarks: tiny models of real architectures (`factory`)."""
