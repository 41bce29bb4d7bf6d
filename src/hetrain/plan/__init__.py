"""Planners: pure functions on plain data (no torch.distributed) that decide who does what.

allocate.py  C-ADP data allocation: exact min-makespan shares (water-filling), integer
             rounding with a proven bound, local steps per synchronisation.
graph.py, sbp.py, cost.py, search.py  AutoDDL: layer graphs, SBP placements and boxing costs,
             the analytical cost model and the search over placements.
"""
