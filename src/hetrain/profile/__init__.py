"""ASHL stage 0: per-worker profiles (step, push, pull time) and the local-iteration plan."""

from hetrain.profile.plan_iterations import (
    FractionalSteps,
    LocalPlan,
    OnlineCosts,
    commit_round_cap_s,
    epoch_time_s,
    plan_for_comm_fraction,
    plan_for_fastest,
    plan_local_steps,
)
from hetrain.profile.profile import Profile, WorkerProfile, worker_profiles

__all__ = ["FractionalSteps", "LocalPlan", "OnlineCosts", "Profile", "WorkerProfile",
           "commit_round_cap_s", "epoch_time_s", "plan_for_comm_fraction", "plan_for_fastest",
           "plan_local_steps", "worker_profiles"]
