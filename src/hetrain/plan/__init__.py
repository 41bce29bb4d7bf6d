"""Planners: pure functions on plain data (no torch.distributed) that decide who does what.

allocate.py  C-ADP data allocation: exact min-makespan shares (water-filling), integer
             rounding with a proven bound, local steps per synchronisation.
local_steps.py  ASHL/ADSP: local steps per worker from a Profile so that pull + compute +
             push take the same time everywhere; OnlineCosts, the measured costs it re-plans on.
graph.py, sbp.py, cost.py, search.py  AutoDDL: layer graphs, SBP placements and boxing costs,
             the analytical cost model and the search over placements.
"""
