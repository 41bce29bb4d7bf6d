"""ASHL stage 0: per-worker profiles (step, push, pull time) and the local-iteration plan."""

from hetrain.profile.plan_iterations import LocalPlan, plan_for_fastest, plan_local_steps
from hetrain.profile.profile import Profile, WorkerProfile, worker_profiles

__all__ = ["LocalPlan", "Profile", "WorkerProfile", "plan_for_fastest", "plan_local_steps",
           "worker_profiles"]
