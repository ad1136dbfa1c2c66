"""Evaluation on fixed seeded episodes, split over the env servers, surviving env and inference restarts."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from opentelemetry import trace

from rlfleet.config.views import CoordinatorView
from rlfleet.v1 import rollout_pb2
from rlfleet.wire import codec
from services.coordinator.calls import CallFailed, FleetCalls, describe, retryable
from services.coordinator.service_registry import RunFailed

_tracer = trace.get_tracer("rlfleet")


def _check_episodes(resp, first: int, count: int, peer: str) -> None:
    """An EvaluateResponse's claims, before they are counted: at most ``count`` episodes (the ones asked for),
    each an episode index in ``[first, first + count)``, and a lost-episode count that is not negative. Refused
    with RunFailed naming the env server, the field, the limit and the claim."""
    if len(resp.episodes) > count:
        raise RunFailed(
            f"{peer} answered Evaluate with {len(resp.episodes):,} episodes; at most {count:,} were asked "
            f"for (episodes {first}..{first + count - 1})"
        )
    bad = [e.env_id for e in resp.episodes if not first <= e.env_id < first + count]
    if bad:
        raise RunFailed(
            f"{peer} answered Evaluate with episode index {bad[0]}; the episodes asked for are "
            f"{first}..{first + count - 1}"
        )
    if resp.lost_episodes < 0:
        raise RunFailed(f"{peer} answered Evaluate with lost_episodes {resp.lost_episodes}; a count is >= 0")


class Evaluator:
    def __init__(
        self, view: CoordinatorView, run_dir, calls: FleetCalls, say, eval_simulator: Callable[[int], str] | None = None
    ):
        """``eval_simulator(i)``: env server i's evaluation simulator, in a run over several simulators
        (env.per_server; None otherwise)."""
        self.view, self.run_dir, self.calls, self.say = view, run_dir, calls, say
        self.eval_simulator = eval_simulator
        self.episodes: list = []  # the last evaluation's EpisodeStats, in episode order
        self.episode_simulators: dict[int, str] = {}

    def evaluate(
        self, step: int, num_episodes: int | None = None, *, video_dir: str | None = None, progress=None
    ) -> dict[str, float]:
        """``num_episodes`` (default env.eval.num_episodes) seeded episodes; episode i is reset with seed + i
        wherever it runs. -> eval/* metrics; ``self.episodes``: every episode's stats, in episode order (the
        EpisodeStats' env_id is the episode index). ``video_dir``: where videos go (default
        <run>/videos/eval_epochNNNN). ``progress(done, total)``: called as episodes finish; each server's share
        is then asked for in pieces of its eval envs, so that progress is seen during a long evaluation."""
        ev, calls = self.view.eval, self.calls
        total = num_episodes or ev.num_episodes
        n = calls.registry.counts["env"]
        shares = [len(a) for a in np.array_split(np.arange(total), n)]
        firsts = np.cumsum([0] + shares[:-1])
        per_server = max(1, ev.total_num_envs // self.view.num_env_servers)  # fixed per server
        if video_dir is None:
            video_dir = str(self.run_dir / "videos" / f"eval_epoch{step:04d}") if ev.video_episodes else ""
        elif not ev.video_episodes:
            video_dir = ""
        t0 = time.perf_counter()
        done = [0]

        def pieces(i):
            size = per_server if progress is not None else max(1, shares[i])
            return [(int(firsts[i]) + k, min(size, shares[i] - k)) for k in range(0, shares[i], size)]

        def piece(i, first, count):
            for _ in range(self.view.max_restarts + 1):
                if calls.registry.collocated:  # a (re)started env server holds no policy until the learner publishes
                    calls.ensure_inference_weights()
                svc, stub = calls.rollout_stub(i)
                incarnation, generation = svc.incarnation, calls.registry.inference_generation()
                try:
                    resp = stub.Evaluate(
                        rollout_pb2.EvaluateRequest(
                            num_episodes=count,
                            first_episode=first,
                            seed=ev.seed,
                            deterministic=ev.deterministic,
                            inference_addresses=calls.registry.act_addresses(),
                            use_reset_state_ids=ev.use_fixed_reset_state_ids,
                            video_episodes=ev.video_episodes,
                            video_dir=video_dir,
                            policy_spec=calls.policy_spec,
                        ),
                        timeout=self.view.collect_timeout_s,
                    )
                    _check_episodes(resp, first, count, f"env[{i}] ({svc.address})")
                    calls.add_lost(resp.lost_episodes)
                    if progress is not None:
                        with calls.lock:
                            done[0] += len(resp.episodes)
                            progress(done[0], total)
                    return list(resp.episodes)
                except CallFailed as exc:
                    if not retryable(exc) or calls.fate.fatal:
                        raise
                    calls.settle(svc, incarnation, generation)
                    if not calls.same(svc, incarnation):
                        lost = min(count, per_server)
                        calls.add_lost(lost)
                        self.say(
                            f"  ! env[{i}] lost mid-evaluation ({describe(exc).splitlines()[0]}); "
                            f"{lost} episodes in flight lost, evaluating its share again after restart"
                        )
                        continue
                    if calls.registry.inference_generation() == generation:
                        raise
                    calls.ensure_inference_weights()  # an inference server restarted: evaluate again
            raise RunFailed(f"env[{i}] evaluation failed {self.view.max_restarts + 1} times")

        def one(i):
            return [e for first, count in pieces(i) for e in piece(i, first, count)]

        with (
            ThreadPoolExecutor(n) as pool,
            _tracer.start_as_current_span("evaluate", attributes={"rlfleet.step": step}),
        ):
            futures = [pool.submit(contextvars.copy_context().run, one, i) for i in range(n) if shares[i]]
            results = [f.result() for f in futures]
        eps = [e for r in results for e in r]
        self.episodes = sorted(eps, key=lambda e: e.env_id)
        self.episode_simulators = {}  # episode index -> simulator, in a run over several simulators
        by_sim = {}  # a run over several simulators (env.per_server): success per simulator too
        if self.eval_simulator is not None:
            for i, r in zip([i for i in range(n) if shares[i]], results):
                sim = self.eval_simulator(i)
                by_sim.setdefault(f"eval/{sim}/success_once", []).extend(e.success_once for e in r)
                self.episode_simulators.update({e.env_id: sim for e in r})
        return {
            **{k: float(np.mean(v)) for k, v in by_sim.items() if v},
            **{k.replace("/success_once", "/num_episodes"): float(len(v)) for k, v in by_sim.items() if v},
            "eval/success_once": float(np.mean([e.success_once for e in eps])),
            "eval/success_at_end": float(np.mean([e.success_at_end for e in eps])),
            "eval/return": float(np.mean([codec.episode_return(e) for e in eps])),
            "eval/episode_len": float(np.mean([e.length for e in eps])),
            "eval/num_episodes": float(len(eps)),
            "time/eval": time.perf_counter() - t0,
        }
