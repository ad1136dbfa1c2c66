"""RolloutWorker: the obs -> act -> step loop that runs next to the envs.

The worker's envs are split into ``pipeline_stage_num`` stages, each with its own request in flight to the
inference servers: while one stage's actions are computed, another stage's envs step. Finished rollouts are
shipped whole to the learner (the learner commits a rollout only when its stream ends cleanly, so a crash
never leaves half a rollout in a batch).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from opentelemetry import metrics, trace

from rlfleet import errors
from rlfleet.data import videos
from rlfleet.wire.clients import WireStats, make_policy_client
from rlfleet.wire.codec import FI, OBS, EpisodeStat, Rollout, add_policy_buffers, empty_buffers, make_tail, row_keys
from rlfleet.wire.spaces import TensorSpace
from services.env.policy_spaces import PolicySpaceEnv
from services.env.remote import MAX_SIMULATOR_FAULTS, EnvConnectionLost
from services.env.vec_env_interface import VecEnvInterface, step_chunk

_EVAL_EPOCH = 2**40  # evaluation episodes' noise keys: (eval seed + episode, this, step), apart from training's

log = logging.getLogger(__name__)

_tracer = trace.get_tracer("rlfleet")
_meter = metrics.get_meter("rlfleet")
_ACT_WAIT = _meter.create_histogram("rlfleet.env.act_wait", "s", "wait for an inference answer")
_STEP_LATENCY = _meter.create_histogram("rlfleet.env.step_latency", "s", "one env step of a pipeline stage")
_STEPS = _meter.create_counter("rlfleet.env.steps", "1", "env steps taken in rollouts")


class StaleWeightsError(errors.FailedPrecondition):
    """The inference servers serve older weights than the request needs (``min_weights_version``)."""


class Cancelled(errors.Cancelled):
    """The caller went away or the deadline passed; the worker stopped between steps."""


def _never() -> bool:
    return False


@dataclass
class CollectSummary:
    epoch: int
    env_steps: int
    episodes: list[EpisodeStat] = field(default_factory=list)
    rollout_time_s: float = 0.0
    env_time_s: float = 0.0
    inference_wait_s: float = 0.0
    weights_version: int = -1
    act_wire: WireStats = field(default_factory=WireStats)  # the Act streams' share of the wire in this epoch


def _wire_stats(policy) -> WireStats:
    """A policy client's wire cost so far (none for one that has no wire)."""
    stats = getattr(policy, "wire_stats", None)
    return stats() if stats is not None else WireStats()


def _unwrapped(env: VecEnvInterface) -> VecEnvInterface:
    return env.env if isinstance(env, PolicySpaceEnv) else env


class RolloutWorker:
    """The rollout loop in front of ``env`` (any VecEnvInterface: services.env.vec_env_interface)."""

    def __init__(
        self,
        env: VecEnvInterface,
        num_stages: int,
        *,
        auto_reset: bool = True,
        eval_env_factory=None,
        group_size: int = 1,
        use_fixed_reset_state_ids: bool = False,
        seed: int = 0,
        step_spans: bool = False,
    ):
        self.env = env
        self.step_spans = step_spans  # a span per act wait and per env step (tracing set up, telemetry.step_spans)
        self.group_size = group_size
        self.use_fixed_reset_state_ids = use_fixed_reset_state_ids
        self.seed = seed
        self.num_stages = num_stages
        self.stages = np.array_split(np.arange(env.num_envs), num_stages)
        self.auto_reset = auto_reset
        self.eval_env_factory = eval_env_factory
        self.eval_env = None
        self.observation_space = env.observation_space
        self.action_dim = env.action_space.size
        self.obs = env.reset()
        self.instructions = np.array(list(env.instructions) or [""] * env.num_envs, dtype=object)

    def use_policy_spaces(self, observation_space: dict[str, TensorSpace], action_space: TensorSpace) -> None:
        """Act in the run's policy spaces (a run whose env servers host different simulators): the train and
        eval envs are seen through :class:`PolicySpaceEnv` (padded observations, actions cut to this simulator's
        dimensions). The same spaces again: nothing changes. Raises ValueError when this env cannot fit them."""
        if isinstance(self.env, PolicySpaceEnv) and (self.env.observation_space, self.env.action_space) == (
            observation_space,
            action_space,
        ):
            return
        self.env = PolicySpaceEnv(_unwrapped(self.env), observation_space, action_space)
        if self.eval_env is not None:
            self.eval_env = self._in_policy_spaces(_unwrapped(self.eval_env))
        self.observation_space = dict(observation_space)
        self.action_dim = action_space.size
        self.obs = self.env.pad(self.obs)

    @property
    def own_env(self) -> VecEnvInterface:
        """This worker's own simulator (its spaces not padded to the policy's)."""
        return _unwrapped(self.env)

    def _in_policy_spaces(self, env):
        """An eval env seen as the training env is: the training env itself when one env serves both."""
        if env is _unwrapped(self.env):
            return self.env
        if isinstance(self.env, PolicySpaceEnv):
            return PolicySpaceEnv(env, self.env.observation_space, self.env.action_space)
        return env

    def _eval_env(self):
        if self.eval_env is None:
            self.eval_env = self._in_policy_spaces(self.eval_env_factory())
        return self.eval_env

    # --- training rollouts ------------------------------------------------------------------------------------
    def reset_all(self, epoch: int | None = None) -> None:
        """Start fresh episodes on every env. With groups (GRPO), consecutive envs of ``group_size`` start from
        one shared initial state: one seed per group (drawn from the worker's seed and the epoch) and, with
        ``use_fixed_reset_state_ids`` on an env that has fixed initial states, one state id per group."""
        n = self.env.num_envs
        if self.group_size > 1 and epoch is not None:
            groups = np.arange(n) // self.group_size
            rng = np.random.default_rng([self.seed, epoch])
            seeds = rng.integers(0, 2**31 - 1, size=groups[-1] + 1)[groups].tolist()
            states = None
            num_states = self.env.num_reset_states
            if self.use_fixed_reset_state_ids and num_states:
                states = rng.integers(0, num_states, size=groups[-1] + 1)[groups].tolist()
            self.obs = self.env.reset(None, seeds, states)
        else:
            self.obs = self.env.reset()
        self.instructions[:] = list(self.env.instructions) or [""] * n

    def _submit(self, policy, stage: int, ids: np.ndarray, request: dict, epoch: int, step: int) -> None:
        """Ask for actions for env rows ``ids`` at (epoch, step); each row carries a noise key from its env's seed,
        the epoch and the step, so its sampled action is the same in every run with this seed (rlfleet.wire.codec)."""
        policy.submit(
            stage, request, False, list(self.instructions[ids]), row_keys(self.seed + ids.astype(np.int64), epoch, step)
        )

    def _step_span(self, name: str, stage: int, rows: int):
        """A span for one act wait or env step of a pipeline stage (only with ``step_spans``)."""
        if not self.step_spans:
            return contextlib.nullcontext()
        return _tracer.start_as_current_span(name, attributes={"rlfleet.stage": stage, "rlfleet.rows": rows})

    def collect(
        self, epoch: int, num_steps: int, policy, min_weights_version: int = -1, should_stop=_never, buffers=None
    ) -> tuple[Rollout, CollectSummary]:
        """One rollout epoch of ``num_steps`` steps per env: every env's observations, the policy's answers, rewards,
        terminations and truncations, and its tail: the observations after the last step and the final observation
        of each episode that ended (the learner bootstraps from them; nothing here asks for a value).
        ``should_stop()`` is polled between steps; when it says so the collection ends with ``Cancelled`` (the
        caller went away, or its deadline passed).
        ``buffers``: where the observation buffers live ({name: (shape, dtype)} -> arrays; a shared-memory arena's
        ``buffers``, so that the push hands them over without a copy), None: ordinary memory."""
        t_start = time.perf_counter()
        env, T, n = self.env, num_steps, self.env.num_envs
        wire0 = _wire_stats(policy)
        if not self.auto_reset:
            self.reset_all(epoch)
        buf = empty_buffers(
            T, n, self.observation_space, buffers
        )  # the rollout schema's fields (rlfleet/wire/codec.py)
        alive = np.ones(n, bool)
        episodes: list[EpisodeStat] = []
        finals: dict[int, dict[str, np.ndarray]] = {}  # row t * n + env -> the final observation of its episode
        t = [0] * self.num_stages
        env_time = wait_time = 0.0
        version = None
        for s, ids in enumerate(self.stages):
            self._submit(policy, s, ids, {k: v[ids] for k, v in self.obs.items()}, epoch, 0)
        active = list(range(self.num_stages))
        while active:
            if should_stop():
                raise Cancelled(f"epoch {epoch} collection cancelled after {min(t)} of {T} steps")
            for s in list(active):
                ids = self.stages[s]
                m = len(ids)
                t0 = time.perf_counter()
                with self._step_span("act", s, m):
                    res = policy.result(s)
                t1 = time.perf_counter()
                wait_time += t1 - t0
                _ACT_WAIT.record(t1 - t0, {"stage": s})
                if res.weights_version < min_weights_version:
                    raise StaleWeightsError(
                        f"min_weights_version: inference served weights version "
                        f"{res.weights_version}; epoch {epoch} needs version >= "
                        f"{min_weights_version}"
                    )
                version = res.weights_version if version is None else min(version, res.weights_version)
                if "log_probs" not in buf:  # shapes come from the policy (chunk, log-prob width, forward inputs)
                    add_policy_buffers(buf, T, n, res.actions, res.log_probs, res.forward_inputs)
                step = t[s]
                for k, v in self.obs.items():
                    buf[f"{OBS}{k}"][step, ids] = v[ids]
                buf["actions"][step, ids] = res.actions[:m]
                buf["log_probs"][step, ids] = res.log_probs[:m]
                buf["weights_version"][step, ids] = res.weights_version
                if res.values is not None:
                    buf["values"][step, ids] = res.values[:m]
                for k, v in res.forward_inputs.items():
                    buf[f"{FI}{k}"][step, ids] = v[:m]
                t2 = time.perf_counter()
                with self._step_span("env.step", s, m):
                    out = step_chunk(env, ids, res.actions[:m])
                dt = time.perf_counter() - t2
                env_time += dt
                _STEP_LATENCY.record(dt, {"stage": s})
                _STEPS.add(m * res.actions.shape[1])
                buf["rewards"][step, ids] = out.rewards
                buf["terminated"][step, ids] = out.terminated
                buf["truncated"][step, ids] = out.truncated
                buf["loss_mask"][step, ids] = alive[ids]
                if not self.auto_reset:
                    alive[ids] &= ~(out.terminated | out.truncated)
                episodes.extend(out.episodes)
                for j, row in enumerate(out.final_rows):
                    finals[step * n + int(ids[row])] = {k: v[j] for k, v in out.final_obs.items()}
                for k, v in out.obs.items():
                    self.obs[k][ids] = v
                self.instructions[ids] = out.instructions or self.instructions[ids]
                t[s] += 1
                if t[s] == T:
                    active.remove(s)
                    continue
                self._submit(policy, s, ids, {k: v[ids] for k, v in self.obs.items()}, epoch, t[s])
        rollout = Rollout(buf, self._tail(finals), episodes)
        chunk = buf["actions"].shape[2] if "actions" in buf else 1
        summary = CollectSummary(
            epoch,
            T * n * chunk,
            episodes,
            time.perf_counter() - t_start,
            env_time,
            wait_time,
            -1 if version is None else version,
            _wire_stats(policy) - wire0,
        )
        return rollout, summary

    def _tail(self, finals: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The rollout's tail (rlfleet.wire.codec): the observations now (after the last step) and the final
        observations of the episodes that ended, by row."""
        rows = sorted(finals)
        final = {k: np.stack([finals[r][k] for r in rows]) for k in self.obs} if rows else None
        return make_tail({k: v.copy() for k, v in self.obs.items()}, rows, final)

    # --- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(
        self,
        episode_ids: list[int],
        seed: int,
        deterministic: bool,
        policy,
        *,
        use_reset_state_ids: bool = False,
        max_episode_steps: int | None = None,
        should_stop=_never,
        video_episodes: int = 0,
        video_dir: str = "",
    ) -> list[EpisodeStat]:
        """Run the given evaluation episodes: episode i is reset with seed + i and, with ``use_reset_state_ids``
        on an env with fixed initial states, from state i % num_reset_states. Returns their stats; an episode
        still running after ``max_episode_steps`` (default: the env's) is ended there, unsuccessful so far.
        Episodes with index < ``video_episodes`` are recorded into ``video_dir`` (rlfleet.data.videos)."""
        env = self._eval_env()
        try:
            return self._evaluate(
                env,
                episode_ids,
                seed,
                deterministic,
                policy,
                use_reset_state_ids,
                max_episode_steps or env.max_episode_steps,
                should_stop,
                video_episodes if video_dir else 0,
                video_dir,
            )
        finally:
            if env is self.env:  # an external sim serving both: training continues from fresh episodes
                self.reset_all()

    def _evaluate(
        self,
        env,
        episode_ids,
        seed,
        deterministic,
        policy,
        use_states,
        max_steps,
        should_stop,
        video_episodes: int = 0,
        video_dir: str = "",
    ) -> list[EpisodeStat]:
        results: list[EpisodeStat] = []
        cams = videos.image_keys(env.observation_space) if video_episodes else []
        num_states = env.num_reset_states if use_states else 0
        for start in range(0, len(episode_ids), env.num_envs):
            batch = episode_ids[start : start + env.num_envs]
            ids = np.arange(len(batch))
            states = [i % num_states for i in batch] if num_states else None
            obs = env.reset(ids, [seed + i for i in batch], states)
            instructions = list(env.instructions)
            instructions = [instructions[i] if i < len(instructions) else "" for i in ids]
            done = np.zeros(len(batch), bool)
            ret, length, succ = np.zeros(len(batch)), np.zeros(len(batch), int), np.zeros(len(batch), bool)
            filmed = {int(i): [] for i in ids if batch[i] < video_episodes} if cams else {}

            def film(rows):
                for i in rows:
                    if int(i) in filmed:
                        filmed[int(i)].append(videos.tile({k: obs[k][i] for k in cams}, cams))

            film(ids)
            for step in range(max_steps):
                if should_stop():
                    raise Cancelled(f"evaluation cancelled after {len(results)} of {len(episode_ids)} episodes")
                live = np.flatnonzero(~done)
                # keyed noise also for deterministic acting: a flow policy (π0) integrates its ODE from a noise
                # sample (seeded per episode and step); the others ignore it when deterministic
                policy.submit(
                    0,
                    {k: v[live] for k, v in obs.items()},
                    deterministic,
                    [instructions[i] for i in live],
                    row_keys(np.asarray(batch)[live] + seed, _EVAL_EPOCH, step),
                )
                res = policy.result(0)
                out = step_chunk(env, ids[live], res.actions)
                ret[live] += out.rewards
                length[live] += 1
                succ[live] |= out.success
                for ep in out.episodes:
                    if not done[ep.env_id]:
                        results.append(
                            EpisodeStat(
                                batch[ep.env_id],
                                ep.episode_return,
                                ep.length,
                                ep.success_once,
                                ep.success_at_end,
                                ep.reset_state_id,
                                ep.instruction,
                            )
                        )
                        done[ep.env_id] = True
                for j, i in enumerate(live):
                    for k in obs:
                        obs[k][i] = out.obs[k][j]
                film(live)
                if done.all():
                    break
            for i in np.flatnonzero(~done):  # cut at max_steps
                results.append(
                    EpisodeStat(
                        batch[i],
                        float(ret[i]),
                        int(length[i]),
                        bool(succ[i]),
                        False,
                        -1 if states is None else states[i],
                        instructions[i],
                    )
                )
            self._write_videos(filmed, batch, seed, results, video_dir)
        return results

    @staticmethod
    def _write_videos(filmed: dict[int, list], batch, seed: int, results: list[EpisodeStat], video_dir: str) -> None:
        success = {r.env_id: r.success_once for r in results}  # env_id holds the episode index here
        for i, frames in filmed.items():
            if not frames:
                continue
            episode = int(batch[i])
            try:
                videos.write_gif(
                    pathlib.Path(video_dir) / videos.video_name(episode, seed + episode, success.get(episode, False)),
                    frames,
                )
            except (ImportError, OSError) as exc:  # a video is a by-product: never fail the evaluation for it
                log.warning("could not write the video of evaluation episode %d: %s", episode, exc)

    def close(self) -> None:
        self.env.close()
        if self.eval_env is not None and self.eval_env is not self.env:
            self.eval_env.close()


# --- PolicyRunner: runs a rollout worker's calls (Collect, Evaluate) with the policy clients they need, and recovers (was services/env/policy_runner.py)
T = TypeVar("T")


class PolicyRunner:
    def __init__(
        self,
        worker: RolloutWorker,
        index: int,
        *,
        act_timeout_s: float = 120.0,
        reconnect_timeout_s: float = 120.0,
        shared_memory: bool = True,
        local_policy=None,
    ):
        self.worker, self.index = worker, index
        # collocated acting: the policy held in this process (rlfleet.policies.local.LocalPolicy), acted with
        # directly whatever inference addresses a call names; None: ask the inference servers over Act streams
        self.local_policy = local_policy
        self.act_timeout_s, self.reconnect_timeout_s = act_timeout_s, reconnect_timeout_s
        self.shared_memory = shared_memory  # observations by handle to inference servers on this host
        self._policy = None  # Act streams kept open across calls: (addresses, stages, action width) -> client
        self._policy_key = None

    def policy_for(self, addresses: Sequence[str], stages: int):
        """The policy client for these inference servers and stages (the open one when they are the same)."""
        key = (tuple(addresses), stages, self.worker.action_dim)
        if self._policy_key != key:
            self.drop_policy()
            target = self.local_policy if self.local_policy is not None else list(addresses)
            self._policy = make_policy_client(
                target, stages, self.worker.action_dim, self.act_timeout_s, self.shared_memory
            )
            self._policy_key = key
        return self._policy

    def await_weights(self, version: int, timeout: float, should_stop: Callable[[], bool] = _never) -> None:
        """Collocated acting: wait up to ``timeout`` s for the policy held here to reach weights ``version`` (a
        synchronous epoch's Collect arrives while the learner still trains on the one before). Acting through
        inference servers there is nothing to wait for here: each answer's version is checked as it comes."""
        held = self.local_policy
        if held is None or timeout <= 0 or held.version >= version:
            return
        if not held.wait_for_version(version, timeout, should_stop):
            if should_stop():
                raise Cancelled(f"cancelled while waiting for weights version {version} (holding {held.version})")
            raise StaleWeightsError(
                f"min_weights_version: weights version {version} did not arrive within {timeout:g} s "
                f"(weights_wait_s); this env server's policy holds version {held.version}"
            )

    def drop_policy(self) -> None:
        if self._policy is not None:
            self._policy.close()
        self._policy = self._policy_key = None

    def run(
        self, addresses: Sequence[str], run: Callable[[object], T], after_loss: Callable[[], object] | None = None
    ) -> tuple[T, int]:
        """``run(policy)`` with the policy client of ``addresses``; when an external simulator dies under it, wait
        for the simulator to come back (the episodes in flight are lost), call ``after_loss`` (fresh episodes) and
        run again. -> (result, episodes lost)."""
        lost = faults = 0
        restarting = False  # the episodes were lost: start fresh ones (after_loss) before running again
        while True:
            policy = self.policy_for(list(addresses), self.worker.num_stages)
            try:
                if restarting and after_loss is not None:
                    after_loss()
                restarting = False
                return run(policy), lost
            except EnvConnectionLost as exc:
                self.drop_policy()
                faults += exc.answered
                if faults > MAX_SIMULATOR_FAULTS:
                    raise errors.InvalidRequest(
                        f"{exc} (simulator failure {faults} in one call; after {MAX_SIMULATOR_FAULTS} the run stops)"
                    ) from None
                if not restarting:
                    print(f"env[{self.index}]: {exc}; its {exc.env.num_envs} episodes in flight are lost", flush=True)
                    lost += exc.env.num_envs
                else:
                    print(f"env[{self.index}]: {exc} (while starting fresh episodes)", flush=True)
                exc.env.reconnect(self.reconnect_timeout_s)
                restarting = True
            except BaseException:
                self.drop_policy()  # streams may hold unanswered requests: start clean next time
                raise

    def close(self) -> None:
        self.drop_policy()
