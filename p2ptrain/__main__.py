"""`python -m p2ptrain` (and `torchrun -m p2ptrain peer …` for a node of several processes) runs the CLI."""

from p2ptrain.cli import main

main()
