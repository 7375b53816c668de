"""The memory plan (`p2ptrain plan`, `peer --plan`): what a peer needs on its device and host, and what fits.

`plan` (the estimate and the advice), `shape` (a model's sizes, read on the meta device), `buffers` (host buffers per
sync mode), `report` (the table and JSON), `measure` (the same run measured on CPU, for the benchmark and tests).
A top-level concept: it reads the wings (maths, sync) and is imported by the CLI only.
"""
