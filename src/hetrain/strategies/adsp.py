"""ADSP (Hu et al., AAAI 2020, arXiv 1911.06949): no waiting, equal commit rates, tuned online.

Time is cut into check periods of length G (seconds, from `Push.arrival_s`). In each period
every worker commits its accumulated update C times, so commits are spaced G / C apart for
everyone: worker i runs tau_i = (G / C) / s_i local steps between commits, proportional to
its speed (s_i its step time: from the profile, then refined from the pushes' measured
`compute_s`). Fast workers run more mini-batches per commit, nobody waits, and all workers
commit equally often. As in the paper, the plan balances computation only; with
`comm_aware = true` it subtracts each worker's pull + push time c_i as well,
tau_i = (G / C - c_i) / s_i (ASHL's stage-0 plan), which matters when links differ. Fractional tau_i are realised by error diffusion
(`FractionalSteps`) so the long-run rates stay exactly equal. Each commit is applied on
arrival; with `weighting = "samples"` its weight is samples_i / (samples all workers commit
in one round), so a round of commits moves the model by the sample-weighted mean of the
updates (the asynchronous counterpart of FedAvg; ASHL uses the same weights, so the two
differ only in protocol); "uniform" gives 1 / n. Both are scaled by `commit_weight`.

The global commit count C is tuned online by a momentum search on training progress (our
reading of the paper's search; its code climbs C while the reward grows). At the end of
period k the reward is the rate of loss decrease R_k = (L_{k-1} - L_k) / G, L_k the mean
training loss of the period's pushes. With direction d (+1: more commits) and velocity v:

    if R_k < R_{k-1}:  d = -d;  v = d          (the last move hurt: turn round, drop momentum)
    else:              v = momentum * v + d    (it helped: keep going, faster)
    C_{k+1} = clip(floor(C_k + v + 1/2), 1, C_max),  C_max = floor(G / (s_slow + c_slow))

C_max is the most commits the slowest worker can make in a period (one step per commit;
its commit time is counted here in both modes).

Every worker commits at least `min_commits_per_epoch` times per epoch, the epoch estimated as
train_samples / (sum of the workers' samples/s) from the current costs: with the round cap
T = epoch / min_commits_per_epoch (`commit_round_cap_s`), the search's lower bound is
C_min = min(C_max, ceil(G / T)) instead of 1, so the interval G / C never exceeds T, and each
worker's tau_i is at most max(1, (T - c_i) / s_i) (ASHL's capped plan: its commit time
counted in both modes; one step where the link alone exceeds T). Where the cap does not bind
the plan is exactly the uncapped one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from hetrain.plan.local_steps import FractionalSteps, OnlineCosts, commit_round_cap_s
from hetrain.profile import Profile
from hetrain.strategies.base import Decision, Push, RunContext, Strategy, WorkTask
from hetrain.strategies.options import MAX_STEPS, fraction, integer, non_negative, positive
from hetrain.strategies.registry import register


@register
@dataclass
class ADSP(Strategy):
    """Asynchronous commits at equal per-worker rates; the global rate searched online."""

    name = "adsp"
    comm = "ps"
    update = "delta"

    check_period_s: Annotated[float, non_negative().with_note("0: automatic")] = 0.0
    """G, the search period; 0: 16 x (slowest worker's step + commit time)."""
    commits_init: Annotated[int, integer(0, MAX_STEPS).with_note("0: auto")] = 0
    """C at the start (commits per worker per period); 0: C_max / 2, at least 1."""
    momentum: Annotated[float, fraction(lo_open=False)] = 0.5
    """Momentum of the commit-rate search."""
    weighting: Literal["samples", "uniform"] = "samples"
    """samples (a round of commits = the sample-weighted average) | uniform (1 / n each)."""
    commit_weight: Annotated[float, positive()] = 1.0
    """Scales every commit's weight."""
    comm_aware: bool = False
    """Subtract each worker's pull + push time from its commit interval (False: the paper's
    speed-proportional plan)."""
    min_commits_per_epoch: Annotated[float, non_negative().with_note("0: no cap")] = 4.0
    """Every worker commits at least this many times per (estimated) epoch: bounds C from
    below and caps each worker's local steps (0: no cap)."""

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        n = ctx.n_workers
        self.costs = OnlineCosts(Profile.from_context(ctx))
        slow = max(range(n), key=lambda i: self.costs.step_s[i] + self.costs.comm_s[i])
        slow_round_s = self.costs.step_s[slow] + self.costs.comm_s[slow]
        self.period_s = self.check_period_s or 16 * slow_round_s
        self.c_max = max(1, math.floor(self.period_s / slow_round_s))
        self._update_cap()
        wanted = min(self.c_max, self.commits_init or max(1, self.c_max // 2))
        self.commits = max(self.c_min, wanted)
        self.floored_periods = int(wanted < self.c_min)
        self.capped_tasks = 0
        self.rounder = FractionalSteps(n)
        self._direction, self._velocity = 1, 0.0
        self._period_end = self.period_s
        self._losses: list[float] = []
        self._prev_loss: float | None = None
        self._prev_reward: float | None = None
        self.commit_counts = [0] * n
        self.history: list[int] = [self.commits]

    def _update_cap(self) -> None:
        """The round cap T from the current costs, and C_min, the fewest commits per period
        that keep G / C <= T."""
        ctx = self.context
        self.round_cap_s = commit_round_cap_s(self.costs.profile(), ctx.train_samples,
                                              self.min_commits_per_epoch, ctx.batch_size)
        self.c_min = 1 if math.isinf(self.round_cap_s) else \
            min(self.c_max, max(1, math.ceil(self.period_s / self.round_cap_s - 1e-9)))

    def _targets(self, worker: int) -> tuple[float, float]:
        """(tau_i, the cap's bound on it)."""
        interval = self.period_s / self.commits
        if self.comm_aware:
            interval -= self.costs.comm_s[worker]
        step_s = self.costs.step_s[worker]
        return (max(1.0, interval / step_s),
                max(1.0, (self.round_cap_s - self.costs.comm_s[worker]) / step_s))

    def local_target(self, worker: int) -> float:
        """tau_i = (G / C) / s_i (comm_aware: (G / C - c_i) / s_i), at least one step, and at
        most the cap's max(1, (T - c_i) / s_i)."""
        return min(self._targets(worker))

    def next_task(self, worker: int) -> WorkTask:
        tau, cap = self._targets(worker)
        self.capped_tasks += cap < tau
        steps = self.rounder.take(worker, min(tau, cap))
        return WorkTask(batch_size=self.context.batch_size, local_steps=steps)

    def _round_samples(self) -> float:
        return self.context.batch_size * sum(self.local_target(w)
                                             for w in range(self.context.n_workers))

    def on_push(self, push: Push) -> Decision:
        self.costs.observe(push.worker, push.compute_s, push.steps, push.comm_s)
        self.commit_counts[push.worker] += 1
        self._update_cap()
        while push.arrival_s >= self._period_end:  # the push belongs to the next period
            self._end_period()
        self._losses.append(push.loss)
        weight = self.commit_weight / self.context.n_workers
        if self.weighting == "samples":
            weight = self.commit_weight * push.samples / self._round_samples()
        return Decision(apply=((push.worker, weight),), release=(push.worker,))

    def _end_period(self) -> None:
        """Close a check period: reward = loss decrease rate; momentum step on C."""
        self._period_end += self.period_s
        if not self._losses:
            return
        loss = sum(self._losses) / len(self._losses)
        self._losses = []
        if self._prev_loss is not None:
            reward = (self._prev_loss - loss) / self.period_s
            if self._prev_reward is not None and reward < self._prev_reward:
                self._direction = -self._direction
                self._velocity = float(self._direction)
            else:
                self._velocity = self.momentum * self._velocity + self._direction
            wanted = min(self.c_max, max(1, math.floor(self.commits + self._velocity + 0.5)))
            self.floored_periods += wanted < self.c_min
            self.commits = max(self.c_min, wanted)
            self._prev_reward = reward
        self._prev_loss = loss
        self.history.append(self.commits)

    def stats(self) -> dict[str, float | int | str]:
        counts = self.commit_counts
        return {"check_period_s": self.period_s, "commits_per_period": self.commits,
                "commits_max": self.c_max, "commit_history": ",".join(map(str, self.history)),
                "commit_counts": ",".join(map(str, counts)),
                "commit_balance": min(counts) / max(counts) if max(counts) else 1.0,
                "round_cap_s": self.round_cap_s if math.isfinite(self.round_cap_s) else 0.0,
                "commits_min": self.c_min, "floored_periods": self.floored_periods,
                "capped_tasks": self.capped_tasks}
