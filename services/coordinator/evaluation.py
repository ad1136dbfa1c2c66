"""Evaluation on fixed seeded episodes, split over the env servers, surviving env and inference restarts."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from rlfleet.wire import codec, rpc, tracing
from rlfleet.config import env_server_config
from rlfleet.v1 import rollout_pb2
from services.coordinator.calls import RETRYABLE, FleetCalls
from services.coordinator.registry import RunFailed


class Evaluator:
    def __init__(self, cfg, run_dir, calls: FleetCalls, say):
        self.cfg, self.run_dir, self.calls, self.say = cfg, run_dir, calls, say

    def evaluate(self, step: int, num_episodes: int | None = None) -> dict[str, float]:
        """``num_episodes`` (default env.eval.num_episodes) seeded episodes; episode i is reset with seed + i
        wherever it runs. -> eval/* metrics."""
        ev, calls = self.cfg.env.eval, self.calls
        total = num_episodes or ev.num_episodes
        n = calls.registry.counts["env"]
        shares = [len(a) for a in np.array_split(np.arange(total), n)]
        firsts = np.cumsum([0] + shares[:-1])
        per_server = ev.total_num_envs // self.cfg.cluster.num_env_servers  # fixed per server
        video_dir = str(self.run_dir / "videos" / f"eval_epoch{step:04d}") if ev.video_episodes else ""
        t0 = time.perf_counter()

        def one(i):
            for _ in range(self.cfg.cluster.max_restarts + 1):
                svc, stub = calls.rollout_stub(i)
                incarnation, generation = svc.incarnation, calls.registry.inference_generation()
                try:
                    resp = stub.Evaluate(rollout_pb2.EvaluateRequest(
                        num_episodes=shares[i], first_episode=int(firsts[i]), seed=ev.seed,
                        deterministic=ev.deterministic, inference_addresses=calls.registry.addresses("inference"),
                        use_reset_state_ids=ev.use_fixed_reset_state_ids, video_episodes=ev.video_episodes,
                        video_dir=video_dir, policy_spec=calls.policy_spec),
                        timeout=self.cfg.cluster.collect_timeout_s)
                    calls.add_lost(resp.lost_episodes)
                    return resp
                except grpc.RpcError as exc:
                    if exc.code() not in RETRYABLE or calls.fate.fatal:
                        raise
                    calls.settle(svc, incarnation, generation)
                    if not calls.same(svc, incarnation):
                        lost = min(shares[i], per_server)
                        calls.add_lost(lost)
                        self.say(f"  ! env[{i}] lost mid-evaluation ({rpc.describe_error(exc).splitlines()[0]}); "
                                 f"{lost} episodes in flight lost, evaluating its share again after restart")
                        continue
                    if calls.registry.inference_generation() == generation:
                        raise
                    calls.ensure_inference_weights()  # an inference server restarted: evaluate again
            raise RunFailed(f"env[{i}] evaluation failed {self.cfg.cluster.max_restarts + 1} times")

        with ThreadPoolExecutor(n) as pool, tracing.span("evaluate", **{"rlfleet.step": step}):
            futures = [tracing.submit(pool, one, i) for i in range(n) if shares[i]]
            results = [f.result() for f in futures]
        eps = [e for r in results for e in r.episodes]
        by_sim = {}  # a run over several simulators (env.per_server): success per simulator too
        if self.cfg.env.per_server:
            for i, r in zip([i for i in range(n) if shares[i]], results):
                sim = env_server_config(self.cfg, i).env.eval.simulator_type
                by_sim.setdefault(f"eval/{sim}/success_once", []).extend(e.success_once for e in r.episodes)
        return {**{k: float(np.mean(v)) for k, v in by_sim.items() if v},
                "eval/success_once": float(np.mean([e.success_once for e in eps])),
                "eval/success_at_end": float(np.mean([e.success_at_end for e in eps])),
                "eval/return": float(np.mean([codec.episode_return(e) for e in eps])),
                "eval/episode_len": float(np.mean([e.length for e in eps])),
                "eval/num_episodes": float(len(eps)), "time/eval": time.perf_counter() - t0}
