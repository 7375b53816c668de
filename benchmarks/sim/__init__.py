"""The in-process simulator behind benchmarks/algorithms.py (and the tests of the maths it runs).

graphs.py      whole gossip graphs of a simulated round, their mixing matrix and the in-place mix
rows.py        the settings of a run and the rows (one algorithm configuration each)
simulation.py  simulated peers: inner phases, each row's exchange with production's outer optimizer, training a row
clock.py       the wall clock with a straggler (transfer times from benchmarks/scale/model.py)
report.py      a summary per row, the sanity check, the targets, Markdown and JSON
tables.py      table 1 (equal tokens), table 2 (equal simulated wall clock) and the report, end to end
"""
