"""Testbeds (loopback, network namespaces), scenarios and reports; used by the CLI only."""
