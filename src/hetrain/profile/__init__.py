"""ASHL stage 0: per-worker profiles (step, push, pull time), priced or measured, and the fit
that turns timed steps into a speed (fit.py). The plan made from a profile, local steps per
worker, is hetrain.plan.local_steps."""

from hetrain.profile.profile import Profile, WorkerProfile, worker_profiles

__all__ = ["Profile", "WorkerProfile", "worker_profiles"]
