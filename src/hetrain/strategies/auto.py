"""`auto`: plan for time to accuracy, not samples per second, and re-plan as training goes.

C-ADP's protocol (synchronous rounds, per-device shares, H local steps, share-weighted delta
averaging at the PS; see cadp.py) with every free choice made by the goodput planner
(hetrain.plan.goodput): which devices take part, the PS's site, the global batch G, the local
steps H and the learning rate. The planner maximises throughput x statistical efficiency,
where efficiency comes from the gradient noise scale (hetrain.plan.noise): early in training
the noise scale is small and big batches waste samples, so the plan is a small G on the
devices that add more compute than their round trips cost, possibly the fastest device alone;
as the noise scale grows, G (and with it the useful cluster) grows.

How it runs:
  * setup: the planner searches every PS site, G and H with the noise-scale prior
    (`noise_scale`; default the base batch for SGD, 16 for Adam-type optimizers) over global
    batches from `min_batch` (8 for SGD, 2 for Adam-type) on the cluster model; the PS
    moves to the chosen site (the simulator moves it; the real engine logs where rank 0
    should run).
  * every task probes the gradient noise on its first batch (WorkTask.probe_noise); the probes
    feed a bias-corrected moving average (GradientNoiseScale).
  * every round the shares are re-allocated from measured compute times (as cadp does), and
    the round's measured length beyond what the model explains (the PS's handling of each
    member's messages: serial, so it grows with the members) becomes the PS's per-member cost
    the planner prices; on the simulator the two agree, on real processes a PS message costs
    milliseconds that no cluster file lists, and small rounds on many devices stop paying;
    every `replan_every_epochs` the planner searches G and H again at the measured noise scale
    times `noise_scale_factor` (3 for SGD, 1 for Adam-type; the PS stays put) and switches
    only if the new plan's predicted goodput beats the current plan's, re-evaluated at the
    same noise scale, by `hysteresis` (no flapping); a switch grows G, and the round's samples
    G x H, by at most `max_batch_growth`.
  * with Adam-type optimizers members push gradients and the PS takes one optimizer step on
    their sample-weighted mean (one step at batch G, at the plan's lr scale); with SGD they
    push parameter deltas after H local steps (`push`).
  * a round whose training loss blows up (`divergence_factor`) is discarded and the plan
    backs off to the one before.
  * the learning rate is AdaScale's gain for G at the noise scale of the plan switch that set
    G (it is not re-tuned between switches unless `lr_follows_noise`), from the batch the
    base lr was tuned for (train.batch_size), its square root for Adam and AdamW
    (`lr_rule`), at most `max_lr_scale` (2): the planner prices the cap, so the lr follows
    the batch smoothly instead of running into it. At a fixed G the gain moves from 1 toward
    G / base batch as the noise scale grows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import numpy as np

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.allocate import Allocation
from hetrain.plan.ema import EMA
from hetrain.plan.goodput import (
    LOCAL_STEPS,
    Costs,
    GoodputPlan,
    StatModel,
    batch_grid,
    best_for,
    cluster_costs,
    explain,
    lone_goodput,
    search,
)
from hetrain.plan.noise import GradientNoiseScale
from hetrain.strategies.base import Decision, Push, RunContext, Update, WorkTask
from hetrain.strategies.cadp import CADP
from hetrain.strategies.options import Limit, fraction, integer, non_negative, positive
from hetrain.strategies.registry import register


@register
@dataclass
class Auto(CADP):
    """Goodput-planned devices, PS site, global batch, local steps and lr; re-planned online."""

    name = "auto"

    noise_scale: Annotated[float, non_negative().with_note(
        "0: train.batch_size with the adascale lr rule, 16 with sqrt")] = 0.0
    """Prior noise scale (samples, in the planner's terms: after noise_scale_factor) for the
    plans before enough probes; 0: by the lr rule, chosen on the goodput benchmark's
    selection seeds (benchmarks/goodput_factor.py --option noise_scale, 8 against 32).
    SGD (adascale): train.batch_size; on MNIST-1D the prior 8 was slower in 5 of 8 cells,
    tied in one (hetero-8 to 85%: 1.50x against 1.75x the tuned lone device;
    results/goodput_prior.md).
    Adam/AdamW (sqrt): 16. On the tiny GPT at min_batch 8 the prior 8 reached both loss
    targets sooner than 32 in all 8 cells (hetero-8 to loss 2.4: 1.52x against 1.31x;
    results/goodput_prior_gpt.md); at min_batch 2, 16 against 8 (the value whose worst
    cell is highest): 1.40x / 1.46x against 1.22x / 1.21x on hetero-4, where 16 plans G 8 on
    all four devices and 8 plans G 3 on two, and 0.86-1.00x of 8's speed-up on the other
    three clusters, where both plan the same G and 16's lr is lower (the sqrt rule's gain
    falls as the noise scale rises); worst cells 1.37x and 1.21x
    (results/goodput_prior16_min_batch2_gpt.md, goodput_min_batch_prior8_gpt.md)."""
    noise_scale_factor: Annotated[float, non_negative().with_note(
        "0: 3 with the adascale lr rule, 1 with sqrt")] = 0.0
    """The planner's noise scale is this multiple of the measured simple noise scale
    B_simple (McCandlish et al. relate B_simple to the critical batch only up to a factor of
    order 1-10); 0: by the lr rule, chosen on the goodput benchmark's selection seeds
    (benchmarks/goodput_factor.py). SGD (adascale): 3, the best of 1, 2, 3, 5 on MNIST-1D,
    fastest or tied in 6 of 8 cells (hetero-4 to 90%: 1.72x, 1.88x, 1.96x, 1.75x the tuned
    lone device; at 1 the plans kept G at 8 for up to 1.5 epochs; results/goodput_factor.md).
    Adam/AdamW (sqrt): 1; on the tiny GPT 3 reached the targets no sooner (hetero-8, lab-6)
    and its larger batches (G 128 on hetero-8) ended 0-0.17 nats of test loss above 1's,
    median 0.11 (results/goodput_factor_gpt.json)."""
    min_batch: Annotated[int, integer(0, 10**9).with_note(
        "0: 8 with the adascale lr rule, 2 with sqrt")] = 0
    """Smallest global batch the planner considers; 0: by the lr rule, chosen on the goodput
    benchmark's selection seeds. SGD (adascale): 8. Adam/AdamW (sqrt): 2; on the tiny GPT,
    with the prior at 8, 2 reached both loss targets sooner than 8 on hetero-8, geo-16 and
    lab-6 (1.59x / 1.53x, 2.15x / 1.93x, 1.90x / 1.91x the tuned lone device against 1.16x /
    1.27x, 1.55x / 1.52x, 1.46x / 1.45x), where a G of 2-3 on the two fastest devices of a
    site beats the lone device at its best batch of 2-4, and later on hetero-4 (1.22x / 1.21x
    against 1.43x / 1.52x; results/goodput_min_batch_prior8_gpt.md), which the prior 16
    mends. A device with a batch of 1 measures no noise (the probe splits a batch in two), so
    a plan of such devices keeps its G and lr."""
    max_batch: Annotated[int, integer(0, 10**9).with_note("0: auto")] = 0
    """Largest global batch the planner considers; 0: an epoch / 16 (at least 16 steps)."""
    local_step_penalty: Annotated[float, Limit(0, 1)] = 1.0
    """p: H local steps on several devices are worth E(G)^(1-p) E(G H)^p per sample; 1 (as
    bad as one step at batch G H) is the safe default: at 0.5 the planner chose H = 32 on
    hetero-8 once and the run ended 12.9 points below the lone device."""
    min_device_batch: Annotated[int, integer(1, 10**9)] = 8
    """With H > 1 on several devices, no device runs a step on fewer samples."""
    replan_every_epochs: Annotated[float, positive()] = 0.1
    """Search G and H again at the measured noise scale this often (epochs of samples)."""
    hysteresis: Annotated[float, Limit(0, 10, hi_open=True)] = 0.05
    """Switch plans only when the new one's predicted goodput is this much higher, at two
    checks in a row (the noise estimate is noisy: one check could be a fluke). 0.05, chosen
    against 0.1 on the goodput benchmark's MNIST-1D selection seeds (the value whose worst
    cell is highest: 1.67x against 1.50x the tuned lone device): the model's goodput of
    G 16 and G 32 on hetero-8 stays within 10% of each other until the noise scale is about
    250, so 0.1 kept G 16 there for 1.4 epochs while accuracy hovered at 86-88% (the
    benchmark's held-out runs of 2026-12-06, 1.32x to 90%); 0.05 reached 90% 1.72x sooner
    than the lone device against 1.50x, and was level or sooner in 6 of 8 cells (hetero-4
    to 90%: 1.71x against 1.89x; results/goodput_hysteresis.md)."""
    noise_ema_weight: Annotated[float, fraction(hi_open=False)] = 0.002
    """Weight of the newest probe in the noise scale's moving averages."""
    min_probes: Annotated[int, integer(0)] = 20
    """Plan with the prior until this many probes have been averaged."""
    max_batch_growth: Annotated[float, Limit(1, math.inf)] = 2.0
    """A re-plan changes G, and grows the samples of a round (G x H) on several devices, by at
    most this factor (Pollux/AdaScale ramp the batch; a sudden jump meets replicas whose
    momentum was built at the old batch: G48xH1 -> G96xH16 in one switch sent geo-16 seed 4
    to NaN). One device alone may take any H at once: its local steps are plain steps, and
    ramping H 1, 2, 4, 8 there only spends rounds on PS round trips (on real processes, where
    auto trains the fast device alone, it cost real_hetero4 its lead over the lone device)."""
    divergence_factor: Annotated[float, Limit(1, math.inf)] = 4.0
    """A round whose members' mean training loss is not finite, or above this many times the
    first round's (an untrained model's), is discarded (applied with weight 0, the members'
    optimizers reset), and the plan goes back to the one before the last switch, with no
    round that large tried again. Not relative to recent rounds: a round of 8 samples at 95%
    accuracy can hold one confidently wrong sample and average 4x the recent loss."""
    max_lr_scale: Annotated[float, Limit(1, math.inf)] = 2.0
    """Cap of the AdaScale lr gain: the base lr is taken as tuned close to its stable maximum
    at train.batch_size (lone-device sweeps diverge at 2-4x of it), and the planner prices
    the cap, so it does not pick batches whose gain would exceed it."""
    lr_rule: Literal["auto", "adascale", "sqrt"] = "auto"
    """adascale | sqrt | auto: the lr scale is AdaScale's gain r (SGD) or sqrt(r) (the
    square-root rule, for Adam-type optimizers); auto picks by the configured optimizer."""
    lr_follows_noise: bool = False
    """Re-evaluate the lr scale every round at the current noise estimate, not only at a
    switch of G or H (a G below the base batch then anneals its lr as the noise grows).
    Off by default: on the goodput benchmark's MNIST-1D selection seeds it raised auto's
    final accuracy in 3 of 4 clusters (0.3-0.8 points; geo-16 lost 0.7) but reached 85%
    1-20% later in all 4 (benchmarks/results/goodput_lr_follow.md)."""
    push: Literal["auto", "delta", "gradient"] = "auto"
    """What members push each round. gradient: their mean gradients over their shares, and
    the PS steps the configured optimizer once on the sample-weighted mean, which is one step
    at batch G, as the lone device takes (H = 1 only; the lr scale is applied at the PS).
    delta: each member steps its own optimizer H times on its share and the PS averages the
    parameter deltas. auto: gradient with Adam-type optimizers, delta with SGD (or when
    local_steps > 1). With SGD the two agree at H = 1 while the shares stay put (momentum is
    linear), and delta lets one device alone run H steps per PS round trip. With Adam they do
    not: each member normalises its own 1-4-sample gradient by its own second moments, and the
    average of those steps is not an Adam step at batch G. On the tiny GPT's selection seeds
    gradient pushes reached the loss targets level or sooner in 7 of 8 cells (worst cell
    1.47x against 1.37x the tuned lone device; hetero-8 to loss 2.6: 1.59x against 1.37x) and
    ended at a lower test loss on all four clusters (1.46-1.50 against 1.48-1.54 nats;
    benchmarks/goodput_factor.py --workload text-gpt --option push --values gradient delta,
    results/goodput_push_gpt.md)."""
    move_ps: bool = True
    """Let the planner choose the PS site (False: keep the cluster's ps_site)."""
    ship_data: bool = False
    """Like the other strategies, devices read their samples locally (True: cadp's data owner)."""
    measure_member_cost: bool = True
    """Price the PS's per-member cost from measured round lengths (False: the cluster
    model's only)."""

    UPDATE_NOTE = "update `gradient` with Adam-type optimizers, `delta` with SGD: see `push`"
    """What docs/config.md says of the update (the class's `update` is only the default)."""
    ADASCALE_MIN_BATCH = 8
    """The smallest global batch with the adascale lr rule (see `min_batch`)."""
    SQRT_PRIOR = 16.0
    """The prior noise scale with the sqrt lr rule (see `noise_scale`)."""
    SQRT_MIN_BATCH = 2
    """The smallest global batch with the sqrt lr rule (see `min_batch`)."""
    MEMBER_ROUNDS = 10
    """Rounds measured before a grown per-member cost triggers a check."""

    goodput_plan: GoodputPlan | None = field(default=None, init=False, repr=False)
    switches: list[tuple[float, int, int]] = field(default_factory=list, init=False, repr=False)
    """(epoch, G, H) of every plan, the first included."""

    # ---- planning -------------------------------------------------------------------------
    def setup(self, ctx: RunContext) -> None:
        self.noise = GradientNoiseScale(self.noise_ema_weight)
        self._base_batch = ctx.batch_size
        rule = self.lr_rule if self.lr_rule != "auto" else (
            "adascale" if ctx.optimizer == "sgd" else "sqrt")
        self._lr_exponent = 1.0 if rule == "adascale" else 0.5
        self._prior = self.noise_scale or (
            float(ctx.batch_size) if rule == "adascale" else self.SQRT_PRIOR)
        self._last_noise: float | None = None
        lo = self.min_batch or (
            self.ADASCALE_MIN_BATCH if rule == "adascale" else self.SQRT_MIN_BATCH)
        hi = self.max_batch or max(lo, ctx.train_samples // 16)
        self._grid = batch_grid(min(lo, hi), hi)
        self._pushes = self._resolve_push(ctx)
        if self._pushes == "gradient":
            self._steps_grid: tuple[int, ...] = (1,)
        else:
            self._steps_grid = (self.local_steps,) if self.local_steps else LOCAL_STEPS
        cl = ctx.cluster
        sites = [s.name for s in cl.sites] if self.move_ps else [cl.ps_site]
        costs = [cluster_costs(cl, s, ctx.flops_per_sample, ctx.model_bytes) for s in sites]
        self.goodput_plan = search(costs, self._stat(), self._grid, self._steps_grid)
        self.ps_site = self.goodput_plan.ps_site
        self._model_costs = next(c for c in costs if c.ps_site == self.ps_site)
        self._samples_seen = 0
        self._candidate: tuple[int, int] | None = None  # a better (G, H) seen at one check
        self._trained: set[int] = set()   # devices whose replica trained in the plan so far
        self._next_check = self._check_interval(ctx)
        self.switches = []
        self._round_open_s: float | None = None   # when the round under way was released
        self._member_cost = EMA(self.ema_weight, what="strategy auto: ema_weight")
        self._checked_member_s = self._model_costs.member_s  # the cost the last check used
        self._first_loss: float | None = None
        self._round_cap = math.inf        # samples per round (G x H) of multi-device plans
        self.discarded_rounds = 0
        # cadp's setup prices links to the cluster's PS: give it the cluster with the PS moved
        super().setup(replace(ctx, cluster=replace(cl, ps_site=self.ps_site)))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.push == "gradient" and self.local_steps > 1:
            raise ConfigError(f"strategy auto: push = \"gradient\" takes one step per round, "
                              f"but local_steps = {self.local_steps}; set push = \"delta\" "
                              "for local steps, or local_steps = 0")

    def _resolve_push(self, ctx: RunContext) -> Update:
        """The `push` option, "auto" decided by the optimizer (see the option)."""
        if self.push != "auto":
            return self.push
        return "gradient" if ctx.optimizer != "sgd" and self.local_steps <= 1 else "delta"

    @property
    def pushes(self) -> Update:
        return self._pushes

    def ps_placement(self) -> str | None:
        return self.ps_site

    def explain_plan(self, cluster: Cluster, flops_per_sample: float
                     ) -> tuple[GoodputPlan, list[str]]:
        """The plan in force, with the goodput of the fastest device alone beside it, and
        the plan in words (`hetrain plan --goodput`); `cluster`: the run's, PS placed."""
        if self.goodput_plan is None:
            raise RuntimeError("strategy auto: explain_plan before setup")
        lone = lone_goodput(cluster, self._stat(), self._grid, flops_per_sample)
        plan = replace(self.goodput_plan, alternatives={"fastest device alone": lone})
        lines = explain(plan, cluster, self._costs(), self.min_device_batch)
        if self._pushes == "gradient":
            lines.append(f"members push gradients: the PS takes one {self.context.optimizer} "
                         f"step per round on their mean, a step at batch "
                         f"{plan.global_batch} (push = \"delta\" averages their own steps)")
        return plan, lines

    def _check_interval(self, ctx: RunContext) -> int:
        return max(1, int(self.replan_every_epochs * ctx.train_samples))

    def _stat(self) -> StatModel:
        """The statistical model at the current noise estimate (the prior before any probe)."""
        measured = self.noise.noise_scale if self.noise.probes >= self.min_probes else None
        if measured is not None:
            self._last_noise = measured * self._noise_factor
        # an estimate that dips to none (the |G|^2 average briefly <= 0 near an optimum, where
        # the probes are mostly noise) keeps the last one rather than falling back to the prior
        return StatModel(self._last_noise or self._prior, self._base_batch,
                         self.local_step_penalty, self.min_device_batch, self.max_lr_scale,
                         self._lr_exponent)

    @property
    def _noise_factor(self) -> float:
        """noise_scale_factor, or by the lr rule when it is 0 (see the option)."""
        return self.noise_scale_factor or (3.0 if self._lr_exponent == 1.0 else 1.0)

    def _costs(self) -> Costs:
        """The round costs to plan with: the model's links, measured compute per sample."""
        c = self._model_costs
        per_sample = tuple(float(x) if self._caps[j] > 0 else float("inf")
                           for j, x in enumerate(self.costs.compute_s))
        member = max(c.member_s, self._measured_member_s or 0.0)
        return Costs(c.ps_site, c.comm_s, c.overhead_s, per_sample, member)

    def _observe_round(self, closed_s: float, shares: tuple[int, ...], steps: int) -> None:
        """Fold a finished round's length into the PS's per-member cost: what the model of
        the members' own times (links, step overheads, measured compute) does not explain,
        per member. The first round (start-up) and rounds after a lost worker are skipped."""
        opened, self._round_open_s = self._round_open_s, closed_s
        active = [j for j, x in enumerate(shares) if x > 0]
        if opened is None or not active or self._lost:
            return
        c = self._model_costs
        own = max(c.comm_s[j] + steps * c.overhead_s[j] + self.costs.compute_s[j] * shares[j]
                  for j in active)
        unexplained = (closed_s - opened) - own
        if unexplained < 1e-9:   # float rounding where the model is exact (the simulator)
            unexplained = 0.0
        per_member = unexplained / len(active)
        # the first measurement replaces the zero start: (1 - 1) * 0 + 1 * x
        self._member_cost.update(per_member, None if self._member_cost.count else 1.0)

    @property
    def _measured_member_s(self) -> float | None:
        """The PS's measured per-member cost (None before a round was measured)."""
        return self._member_cost.value if self._member_cost.count else None

    def _member_cost_grew(self, costs: Costs) -> bool:
        """The measured per-member cost is over twice what the last check planned with (real
        processes: milliseconds per PS message that no cluster file lists). Worth a check at
        once: waiting for the scheduled one spent a fifth of an epoch on many-device rounds
        of a few samples each that cost more than they added (real_hetero4)."""
        return (self._member_cost.count >= self.MEMBER_ROUNDS
                and costs.member_s > 2 * self._checked_member_s + 1e-6)

    def _adopt(self, plan: GoodputPlan) -> None:
        self.goodput_plan = plan
        self.steps = plan.local_steps
        self.global_batch = plan.global_batch
        self.samples_per_round = plan.global_batch * plan.local_steps
        self.mean_batch = max(1, plan.global_batch // len(plan.active))
        self.lr_scale = plan.lr_scale
        epoch = self._samples_seen / self.context.train_samples
        self.switches.append((round(epoch, 4), plan.global_batch, plan.local_steps))

    def _replan(self, back_off: bool = False) -> None:
        """cadp calls this at setup, after every round and when a worker is lost; auto's
        divergence guard with `back_off` after a discarded round."""
        ctx = self.context
        stat = self._stat()
        costs = self._costs()
        current = self.goodput_plan
        assert current is not None
        scheduled = self._samples_seen >= self._next_check
        cost_grew = self.plan is not None and self._member_cost_grew(costs)
        if self.plan is None:                       # setup: the searched plan
            self._adopt(current)
        elif back_off:
            self._back_off(costs, stat)
        elif scheduled or cost_grew or not np.isfinite(
                [costs.per_sample_s[j] for j in current.active]).all():
            if scheduled:
                self._next_check = self._samples_seen + self._check_interval(ctx)
            self._checked_member_s = costs.member_s
            now = best_for(costs, stat, current.global_batch, current.local_steps)
            g, k = current.global_batch, self.max_batch_growth
            grid = [b for b in self._grid if g / k <= b <= g * k]
            most = min(self._round_cap, k * g * current.local_steps)
            best = search([costs], stat, grid, self._steps_grid, max_round_samples=most)
            better = now is None or best.goodput > now.goodput * (1 + self.hysteresis)
            candidate = (best.global_batch, best.local_steps) if better else None
            # the same better plan at two checks in a row (the noise estimate is noisy), or
            # at once when measured costs, not the noise, moved
            if now is None or (better and (candidate == self._candidate or cost_grew)):
                self._adopt(best)
                self._candidate = None
            else:
                self._candidate = candidate
                self._adopt_quietly(now)
        else:
            fresh = best_for(costs, stat, current.global_batch, current.local_steps)
            if fresh is not None:
                self._adopt_quietly(fresh)
        plan = self.goodput_plan
        assert plan is not None
        self.plan = Allocation(plan.shares, plan.round_s, plan.round_s,
                               tuple(float(x) for x in plan.shares), (), (), plan.local_steps)
        self._shares = plan.shares
        self._record_shares()
        # a device that sits out this plan starts afresh (reset_optimizer) when it rejoins
        self._trained &= {j for j, x in enumerate(plan.shares) if x > 0}

    @staticmethod
    def _upgrade_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint written before the divergence guard lacks its state, and one written
        before the PS's per-member cost was an `EMA` holds it as a float (None: unmeasured)
        and a count (hetrain.engine.codec calls this when it reads one back); cadp's upgrade
        first."""
        attrs = CADP._upgrade_attrs(attrs)
        for name, value in (("_first_loss", None), ("_round_cap", math.inf),
                            ("discarded_rounds", 0), ("_pushes", "delta")):
            attrs.setdefault(name, value)
        if "_member_rounds" in attrs:
            cost = EMA(attrs["ema_weight"])
            cost.mean = attrs.pop("_measured_member_s") or 0.0
            cost.count = attrs.pop("_member_rounds")
            attrs["_member_cost"] = cost
        return attrs

    def _back_off(self, costs: Costs, stat: StatModel) -> None:
        """After a discarded round: the plan before the last switch (or, at the first plan,
        the smallest G with H = 1), and no round on several devices as large as the failed
        one from now on."""
        failed = self.goodput_plan
        assert failed is not None
        self._round_cap = min(self._round_cap,
                              failed.global_batch * failed.local_steps / self.max_batch_growth)
        self._trained.clear()                 # every member starts with a fresh optimizer
        self._candidate = None
        if len(self.switches) > 1:
            g, h = self.switches[-2][1:]
        else:
            g, h = self._grid[0], self._steps_grid[0]
        plan = None
        if g * h <= self._round_cap:
            plan = best_for(costs, stat, g, h)
        if plan is None:
            plan = search([costs], stat, self._grid, self._steps_grid,
                          max_round_samples=self._round_cap)
        self._adopt(plan)

    def _round_blew_up(self) -> bool:
        """The guard of `divergence_factor`, on the round being closed (cadp's pending
        pushes)."""
        pushes = list(self._pending.values())
        samples = sum(p.samples for p in pushes)
        if not samples:
            return False
        loss = sum(p.loss * p.samples for p in pushes) / samples
        if not math.isfinite(loss):
            return True
        if self._first_loss is None:
            self._first_loss = loss
        return loss > self.divergence_factor * self._first_loss

    def _close_round(self) -> Decision:
        """cadp's, with the divergence guard: a blown-up round is applied with weight 0 (the
        model stays as it was) and the plan backs off first, so the next round runs on it.
        Gradient pushes: the PS's step takes the lr scale the round ran with (closing it may
        switch the plan, and with it the scale of the next round)."""
        if len(self._pending) < len(self._members):
            return Decision()
        scale = self.lr_scale if self._pushes == "gradient" else 1.0
        if not self._round_blew_up():
            return replace(super()._close_round(), lr_scale=scale)
        self._replan(back_off=True)          # cadp may re-plan again after it: quietly
        self.discarded_rounds += 1
        decision = super()._close_round()
        return replace(decision, apply=tuple((j, 0.0) for j, _ in decision.apply),
                       lr_scale=scale)

    def _adopt_quietly(self, plan: GoodputPlan) -> None:
        """Same G and H with re-allocated shares (measured speeds): not a switch."""
        self.goodput_plan = plan
        self.mean_batch = max(1, plan.global_batch // len(plan.active))
        if self.lr_follows_noise:
            self.lr_scale = plan.lr_scale

    def on_worker_joined(self, worker: int) -> Decision | None:
        """cadp's, with a planner check at once (the device may be worth adding again: its
        measured speed is kept); it starts with a fresh optimizer when the plan includes it."""
        self._next_check = self._samples_seen
        self._trained.discard(worker)
        return super().on_worker_joined(worker)

    # ---- protocol -------------------------------------------------------------------------
    def next_task(self, worker: int) -> WorkTask:
        task = super().next_task(worker)
        member = worker in self._members
        joins = member and worker not in self._trained
        if member:
            self._trained.add(worker)
        else:
            self._trained.discard(worker)
        return WorkTask(task.batch_size, task.local_steps, task.lr_scale, task.data_bytes,
                        probe_noise=task.batch_size >= 2, reset_optimizer=joins)

    def on_push(self, push: Push) -> Decision:
        if push.probe is not None:
            self.noise.observe(push.probe)
        if push.worker in self._members:
            self._samples_seen += push.samples
        plan = self.goodput_plan
        assert plan is not None
        shares, steps = plan.shares, plan.local_steps
        decision = super().on_push(push)
        if decision.apply and self.measure_member_cost:   # the round closed with this push
            self._observe_round(push.arrival_s, shares, steps)
        return decision

    def metrics(self) -> dict[str, float | int | None]:
        plan = self.goodput_plan
        return {"noise_scale": self.noise.noise_scale,
                "planned_noise_scale": plan.noise_scale if plan else None,
                "global_batch": plan.global_batch if plan else None,
                "local_steps": plan.local_steps if plan else None,
                # the scale tasks run with (without lr_follows_noise it is the last switch's,
                # not the plan's figure re-evaluated at every check's noise estimate)
                "lr_scale": self.lr_scale if plan else None}

    def stats(self) -> dict[str, float | int | str]:
        out = super().stats()
        plan = self.goodput_plan
        assert plan is not None
        out.update({"ps_site": plan.ps_site, "pushes": self._pushes,
                    "noise_scale": self.noise.noise_scale or 0.0,
                    "noise_probes": self.noise.probes, "plan_switches": len(self.switches) - 1,
                    "plans": ";".join(f"{e}:G{g}xH{h}" for e, g, h in self.switches),
                    "predicted_samples_per_s": plan.samples_per_s,
                    "predicted_efficiency": plan.efficiency,
                    "active_devices": len(plan.active),
                    "discarded_rounds": self.discarded_rounds,
                    "measured_member_s": self._measured_member_s or 0.0})
        return out
