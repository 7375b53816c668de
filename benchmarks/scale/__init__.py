"""The swarm-scale simulation behind benchmarks/simulate_scale.py.

model.py      links, compute and the transfer model (one exchange, one all-reduce), the fitted exchange constants
sim.py        the event loop: who waits for whom, per algorithm
grid.py       a grid of scenarios, its table, Markdown and JSON
calibrate.py  the transfer model against the push-pull exchanges of a real netns testnet run
"""
