"""The closed sets of names that config fields and command-line flags accept. They live apart from the machinery
they name, so that the CLI builds its flags (and answers --help, --version or a mistyped flag) without importing
torch, transformers or hivemind: seconds per start-up."""

from __future__ import annotations

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # inner.precision: the forward's dtype (maths/inner.py)
STATE_DEVICES = ("auto", "host", "device")  # outer.state_device: where the anchor and momentum live
SYNC_MODES = ("diloco", "gasloc", "factored")  # sync.mode: the outer-sync strategy
ADMISSION_MODES = ("open", "signed")  # network.admission: who may take part in a run
