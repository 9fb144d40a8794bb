"""The Synthesizer's autoscaling policy (serve_app/gpu/autoscaling.py), fed Serve's own
AutoscalingContext and run through Serve's own wrapper (bounds of the decision, upscale and
downscale delays), with made-up replica reports over a made-up clock."""

from __future__ import annotations

import pytest
from ray.serve import autoscaling_policy as serve_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.gpu.autoscaling import (
    SLOT_OCCUPANCY,
    STEP_BUDGET_USED,
    WAITING_STREAMS,
    WORK_DEMAND,
    EngineQueuePolicy,
    engine_signals,
)
from serve_app.engines.base import EngineStats

CONFIG = AutoscalingConfig(min_replicas=1, max_replicas=3, target_ongoing_requests=96,
                           upscale_delay_s=30, downscale_delay_s=120, look_back_period_s=30)


class Cluster:
    """The replicas Serve would run, the policy's state between ticks and a clock."""

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = replicas
        self.state: dict = {}
        self.now = 1_000.0
        self.policy = serve_policy._apply_autoscaling_config(EngineQueuePolicy())

    def tick(self, reports: dict[int, tuple[float, ...] | None],
             seconds: float = 10.0, ongoing: float = 0.0, queued_at_callers: float = 0.0) -> int:
        """One control-loop decision after ``seconds``: ``reports`` per replica index (waiting,
        occupancy, step budget), None for a replica that sent nothing. Applies the decision,
        bounded as Serve bounds it."""
        self.now += seconds
        running = [f"replica-{i}" for i in range(self.replicas)]
        metrics: dict[str, dict[str, float]] = {WAITING_STREAMS: {}, SLOT_OCCUPANCY: {},
                                                STEP_BUDGET_USED: {}, WORK_DEMAND: {}}
        for index, values in reports.items():
            if values is not None:  # (waiting, occupancy, step budget[, work demand])
                for name, value in zip((WAITING_STREAMS, SLOT_OCCUPANCY, STEP_BUDGET_USED,
                                        WORK_DEMAND), values):
                    metrics[name][running[index]] = value
        context = AutoscalingContext(
            deployment_id=None, deployment_name="Synthesizer", app_name="tts",
            current_num_replicas=self.replicas, target_num_replicas=self.replicas,
            running_replicas=running, total_num_requests=ongoing,
            total_queued_requests=queued_at_callers,
            aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=3, policy_state=self.state, last_scale_up_time=None,
            last_scale_down_time=None, current_time=self.now, config=CONFIG)
        decision, self.state = self.policy(context)
        self.replicas = min(max(decision, CONFIG.min_replicas), CONFIG.max_replicas)
        return self.replicas


@pytest.fixture()
def cluster(monkeypatch: pytest.MonkeyPatch) -> Cluster:
    cluster = Cluster()
    monkeypatch.setattr(serve_policy.time, "time", lambda: cluster.now)
    return cluster


def test_rising_load_scales_out_after_the_upscale_delay_and_not_before(cluster: Cluster):
    assert cluster.tick({0: (0, 0.5, 0.3)}) == 1  # under every target
    assert cluster.tick({0: (0, 0.9, 0.4)}) == 1  # occupancy over 0.75: wished, not yet
    assert cluster.tick({0: (0, 0.92, 0.45)}) == 1
    assert cluster.tick({0: (0, 0.95, 0.5)}, seconds=20) == 2  # 30 s of wishing
    # The new replica takes half the load: two replicas hold, nothing wished beyond.
    for _ in range(6):
        assert cluster.tick({0: (0, 0.5, 0.35), 1: (0, 0.45, 0.3)}) == 2


def test_the_step_budget_alone_scales_out(cluster: Cluster):
    for _ in range(4):  # 30 s from the first wish
        cluster.tick({0: (0, 0.3, 0.9)})  # the step at 90% of its budget, slots mostly free
    assert cluster.replicas == 2


def test_waiting_streams_alone_scale_out(cluster: Cluster):
    for _ in range(4):
        cluster.tick({0: (5, 0.5, 0.3)})  # streams waiting for a slot
    assert cluster.replicas == 2


def test_requests_queued_at_the_callers_scale_out(cluster: Cluster):
    """A replica at max_ongoing_requests reports no wait of its own: the callers hold it (seen
    on an H100: slots full, the engine's queue empty, TTFB p99 in seconds)."""
    for _ in range(4):
        cluster.tick({0: (0, 0.7, 0.3)}, queued_at_callers=40)
    assert cluster.replicas == 2


def test_scale_in_only_after_sustained_idleness(cluster: Cluster):
    cluster.replicas = 2
    for _ in range(12):  # the first wish, then 110 s more: under the 120 s downscale delay
        assert cluster.tick({0: (0, 0.1, 0.1), 1: (0, 0.1, 0.1)}) == 2
    assert cluster.tick({0: (0, 0.1, 0.1), 1: (0, 0.1, 0.1)}) == 1
    # The max_replicas-style floor: never below min_replicas however idle.
    for _ in range(20):
        assert cluster.tick({0: (0, 0.0, 0.0)}) == 1


def test_flapping_load_neither_scales_in_nor_out(cluster: Cluster):
    cluster.replicas = 2
    for index in range(40):  # load swinging every 10 s, for 400 s
        high = index % 2 == 0
        report = (0, 0.8, 0.5) if high else (0, 0.1, 0.1)
        assert cluster.tick({0: report, 1: report}) == 2


def test_load_the_remaining_replicas_could_not_take_keeps_them(cluster: Cluster):
    cluster.replicas = 2
    for _ in range(20):  # 0.35 + 0.35 on one replica would be 0.7: near its 0.75 target
        assert cluster.tick({0: (0, 0.35, 0.2), 1: (0, 0.35, 0.2)}) == 2


def test_a_replica_that_stops_reporting_never_counts_as_idle(cluster: Cluster):
    cluster.replicas = 2
    for _ in range(30):  # 300 s: replica 1 silent (starting, stuck or gone)
        assert cluster.tick({0: (0, 0.05, 0.05), 1: None}) == 2
    # A silent replica does not hide load on the others: they still scale out.
    for _ in range(4):
        cluster.tick({0: (0, 1.0, 0.9), 1: None})
    assert cluster.replicas == 3


def test_with_no_reports_at_all_it_falls_back_on_ongoing_requests(cluster: Cluster):
    for _ in range(4):
        cluster.tick({0: None}, ongoing=200.0)  # 200 ongoing over a target of 96
    assert cluster.replicas == 3


def test_engine_signals_from_engine_stats():
    before = EngineStats(steps=100, step_seconds=5.0, max_slots=64, step_budget_s=0.1)
    now = EngineStats(active_streams=48, queued_streams=2, max_slots=64, steps=150,
                      step_seconds=8.0, step_budget_s=0.1)
    signals = engine_signals(now, before, waiting_for_admission=1)
    assert signals == {WAITING_STREAMS: 3.0, SLOT_OCCUPANCY: 0.75,
                       STEP_BUDGET_USED: pytest.approx(0.6), WORK_DEMAND: 0.0}  # 60 ms steps of a 100 ms budget
    idle = engine_signals(now, now, waiting_for_admission=0)
    assert idle[STEP_BUDGET_USED] == 0.0
    no_budget = engine_signals(EngineStats(steps=3, step_seconds=1.0, max_slots=8), None, 0)
    assert no_budget[STEP_BUDGET_USED] == 0.0


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.a10g.yaml",
                                  "serve_config.cpu.yaml", "serve_config.cluster_demo.yaml"])
def test_every_profile_scales_its_synthesizer_with_the_policy(name: str):
    import yaml

    from harness.service import ROOT

    [app] = yaml.safe_load((ROOT / name).read_text())["applications"]
    [synthesizer] = [d for d in app["deployments"] if d["name"] == "Synthesizer"]
    config = AutoscalingConfig(**synthesizer["autoscaling_config"])
    assert config.policy.policy_function == "serve_app.gpu.autoscaling:EngineQueuePolicy"
    policy = EngineQueuePolicy(**config.policy.policy_kwargs)  # the kwargs are its own
    assert 0 < policy.target_occupancy <= 1


def test_refused_work_counts_as_demand(cluster: Cluster):
    # Admission by work keeps the engine under its limit: occupancy and step stay under their
    # targets while streams are refused; the refused load in work_demand asks for a replica.
    assert cluster.tick({0: (0, 0.4, 0.45, 0.7)}) == 1  # admitted work only, under 0.8
    assert cluster.tick({0: (0, 0.4, 0.45, 1.6)}) == 1  # the engine full, as much again refused
    for _ in range(3):  # wished for the 30 s upscale delay
        cluster.tick({0: (0, 0.4, 0.45, 1.6)})
    assert cluster.replicas == 2


def test_the_work_signal_follows_the_engines_admission():
    before = EngineStats(max_slots=1024, steps=10, step_seconds=0.5, step_budget_s=0.1,
                         work_load=0.4, work_limit=0.5, refused_load=1.0)
    now = EngineStats(max_slots=1024, steps=20, step_seconds=1.0, step_budget_s=0.1,
                      work_load=0.5, work_limit=0.5, refused_load=1.25)
    assert engine_signals(now, before, 0)[WORK_DEMAND] == pytest.approx((0.5 + 0.25) / 0.5)
    slots = EngineStats(max_slots=8, work_load=0.3, work_limit=0.0)  # admission by slots
    assert engine_signals(slots, None, 0)[WORK_DEMAND] == 0.0
