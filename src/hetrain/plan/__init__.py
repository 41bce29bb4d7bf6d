"""Planners: pure functions on plain data (no torch.distributed) that decide who does what.

allocate.py  C-ADP data allocation: exact min-makespan shares (water-filling), integer
             rounding with a proven bound, local steps per synchronisation.
local_steps.py  ASHL/ADSP: local steps per worker from a Profile so that pull + compute +
             push take the same time everywhere; OnlineCosts, the measured costs it re-plans on.
ema.py       the moving average every planner smooths measurements with (EMA) and the
             per-worker compute / comm times of cadp and OnlineCosts (WorkerCosts).
noise.py     the gradient noise scale from workers' probes, statistical efficiency.
graph.py, sbp.py, cost.py, search.py  AutoDDL: layer graphs, SBP placements and boxing costs,
             the analytical cost model and the search over placements.
"""
