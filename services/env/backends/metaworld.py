"""Meta-World 3 (``metaworld`` 3.x on MuJoCo 3.3.0) as a backend: MT1 for any of the 50 tasks, MT10, MT50, and
ML10/ML45 train or test splits. Runs in its own environment (rlfleet.simulators.METAWORLD_ENV).

- env_id: a task name (``reach-v3``: MT1, the task's 50 goal variations) or a benchmark (``MT10``, ``MT50``,
  ``ML10``, ``ML45``; params ``split: train|test`` for ML).
- Fixed initial states: the benchmark's tasks (goal variations), built with ``benchmark_seed``. State id k is
  env class k % C, variation k // C, so the first C ids cover every class once. A seeded reset picks a state id
  from the seed; an unseeded (auto-)reset draws one from the slot's generator. A slot switches env class when
  its new state needs another one (one instance per class per slot, created on first use).
- Observation ``state``: the 39-d Meta-World observation, with a one-hot class id appended for multi-class
  benchmarks (``one_hot_task_id``); optional ``pixels`` from a camera (``camera``, ``image_size``; shadows off,
  flipped right side up).
- Success is Meta-World's own ``info['success']``; Meta-World never terminates (episodes end by the time limit).
"""

from __future__ import annotations

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.registry import did_you_mean
from rlfleet.wire.spaces import TensorSpace
from services.env.backends.base import BackendUnavailable, SimBackend, StepResult

BENCHMARKS = ("MT10", "MT25", "MT50", "ML10", "ML25", "ML45")
INSTRUCTIONS = {  # Meta-World ships no language; short imperative descriptions of the MT10 tasks
    "reach": "reach the goal position",
    "push": "push the puck to the goal",
    "pick-place": "pick up the puck and place it at the goal",
    "door-open": "open the door",
    "drawer-open": "open the drawer",
    "drawer-close": "close the drawer",
    "button-press-topdown": "press the button from the top",
    "peg-insert-side": "insert the peg into the hole",
    "window-open": "slide the window open",
    "window-close": "slide the window closed",
}
_UNKNOWN = object()


def instruction_for(env_name: str) -> str:
    base = env_name.removesuffix("-v3")
    return INSTRUCTIONS.get(base, base.replace("-", " "))


class MetaWorldBackend(SimBackend):
    name = "metaworld"

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        split: str = "train",
        benchmark_seed: int = 0,
        one_hot_task_id: bool | None = None,
        camera: str | None = None,
        image_size: int = 64,
        flip_images: bool = True,
        **unknown,
    ):
        super().__init__(env_id, num_envs)
        if unknown:
            raise InvalidRequest(
                f"metaworld: unknown init_params {sorted(unknown)} (known: split, benchmark_seed, "
                f"one_hot_task_id, camera, image_size, flip_images)"
            )
        try:
            import metaworld
        except ImportError as exc:
            raise BackendUnavailable(
                f"metaworld is not installed in this environment ({exc}); env servers for "
                f"simulator_type=metaworld run from its own environment: "
                f"`coordinatorctl envs install metaworld`"
            ) from None
        if split not in ("train", "test"):
            raise InvalidRequest(f"metaworld: split must be train or test, got {split!r}")
        if env_id in BENCHMARKS:
            bench = getattr(metaworld, env_id)(seed=benchmark_seed)
        elif env_id in metaworld.MT1.ENV_NAMES:
            bench = metaworld.MT1(env_id, seed=benchmark_seed)
        else:
            known = list(metaworld.MT1.ENV_NAMES) + list(BENCHMARKS)
            raise InvalidRequest(
                f"metaworld: unknown task '{env_id}'{did_you_mean(env_id, known)}"
                + f" (a task such as reach-v3, or one of {', '.join(BENCHMARKS)})"
            )
        if split == "test" and not env_id.startswith("ML"):
            raise InvalidRequest(f"metaworld: '{env_id}' has no test split (only ML benchmarks do)")
        classes = bench.test_classes if split == "test" else bench.train_classes
        tasks = bench.test_tasks if split == "test" else bench.train_tasks
        self.class_names = list(classes)
        self.classes = dict(classes)
        by_class = {name: [t for t in tasks if t.env_name == name] for name in self.class_names}
        per_class = min(len(v) for v in by_class.values())
        C = len(self.class_names)
        # state id k -> class k % C, variation k // C
        self.states = [
            (self.class_names[k % C], by_class[self.class_names[k % C]][k // C]) for k in range(C * per_class)
        ]
        self.one_hot = (C > 1) if one_hot_task_id is None else bool(one_hot_task_id)
        self.camera, self.image_size, self.flip = camera, int(image_size), flip_images
        self._slots: list[dict[str, object]] = [{} for _ in range(num_envs)]
        self._current: list[object] = [None] * num_envs
        self._raw: list[np.ndarray | None] = [None] * num_envs  # last 39-d observation per slot (the experts' input)
        self._experts: dict[str, object] = {}
        self._class_index = np.zeros(num_envs, np.int64)
        self._rngs = [np.random.default_rng(benchmark_seed + i) for i in range(num_envs)]
        self._drawn: list[int | None] = [None] * num_envs  # each slot's current fixed state (drawn_state_ids)
        probe = self._env(0, self.class_names[0])
        probe.set_task(self.states[0][1])  # the goal is observed once a task is set: its bounds count from here
        base = probe.sawyer_observation_space  # (env.observation_space keeps the space from before set_task)
        low, high = np.asarray(base.low, np.float64), np.asarray(base.high, np.float64)
        if C > 1:  # each task class has its own goal region: the goal entries (last 3) are left unbounded
            low[-3:], high[-3:] = -np.inf, np.inf
        if self.one_hot:
            low, high = np.concatenate([low, np.zeros(C)]), np.concatenate([high, np.ones(C)])
        obs_space = {"state": TensorSpace((low.size,), np.float32, low, high)}
        if camera:
            obs_space["pixels"] = TensorSpace((self.image_size, self.image_size, 3), np.uint8, 0, 255)
        self.observation_space = obs_space
        self.action_space = TensorSpace.from_gym(probe.action_space)
        self.max_episode_steps = int(probe.max_path_length)
        self.num_reset_states = len(self.states)

    def _env(self, slot: int, class_name: str):
        env = self._slots[slot].get(class_name)
        if env is None:
            kwargs = {}
            if self.camera:
                kwargs = dict(
                    render_mode="rgb_array", camera_name=self.camera, width=self.image_size, height=self.image_size
                )
            env = self.classes[class_name](**kwargs)
            env.model.vis.quality.shadowsize = 0  # shadows cost most of the rendering time
            self._slots[slot][class_name] = env
        return env

    def _obs(self, slot: int, raw: np.ndarray) -> dict[str, np.ndarray]:
        state = np.asarray(raw, np.float32)
        if self.one_hot:
            hot = np.zeros(len(self.class_names), np.float32)
            hot[self._class_index[slot]] = 1.0
            state = np.concatenate([state, hot])
        out = {"state": state}
        if self.camera:
            img = self._current[slot].render()
            out["pixels"] = np.ascontiguousarray(img[::-1] if self.flip else img)
        return out

    def drawn_state_ids(self, env_ids) -> list[int | None]:
        return [self._drawn[int(i)] for i in env_ids]

    def reset(self, env_ids, seeds, state_ids):
        rows, texts = [], []
        for i, seed, state in zip(env_ids, seeds, state_ids):
            if seed is not None:
                self._rngs[i] = np.random.default_rng(seed)
            if state is None:
                state = int(self._rngs[i].integers(len(self.states)))
            self._drawn[i] = int(state)  # reported as the episode's reset_state_id, drawn or asked for
            class_name, task = self.states[state]
            env = self._env(i, class_name)
            env.set_task(task)
            if seed is not None:
                env.seed(int(seed) % (2**31))
            raw, _ = env.reset()
            self._current[i] = env
            self._raw[i] = raw
            self._class_index[i] = self.class_names.index(class_name)
            rows.append(self._obs(i, raw))
            texts.append(instruction_for(class_name))
        return {k: np.stack([r[k] for r in rows]) for k in self.observation_space}, texts

    def step(self, env_ids, actions) -> StepResult:
        n = len(env_ids)
        rows, rewards = [], np.zeros(n, np.float32)
        truncated, success = np.zeros(n, bool), np.zeros(n, bool)
        for j, i in enumerate(env_ids):
            env = self._current[i]
            if env.curr_path_length >= env.max_path_length:  # Meta-World refuses to step past its own limit
                raw, reward, trunc, info = env._last_stable_obs, 0.0, True, {"success": 0.0}
            else:
                raw, reward, _, trunc, info = env.step(actions[j])
            self._raw[i] = raw
            rows.append(self._obs(i, raw))
            rewards[j], truncated[j], success[j] = reward, trunc, bool(info.get("success", 0.0))
        obs = {k: np.stack([r[k] for r in rows]) for k in self.observation_space}
        return StepResult(obs, rewards, np.zeros(n, bool), truncated, success)

    def expert_actions(self, env_ids) -> np.ndarray:
        """Meta-World's own scripted policy for each slot's task class (``metaworld.policies``)."""
        from metaworld.policies import ENV_POLICY_MAP

        out = []
        for i in env_ids:
            name = self.class_names[self._class_index[i]]
            if name not in self._experts:
                if name not in ENV_POLICY_MAP:
                    return super().expert_actions(env_ids)
                self._experts[name] = ENV_POLICY_MAP[name]()
            out.append(np.asarray(self._experts[name].get_action(self._raw[i]), np.float32))
        return np.clip(np.stack(out), -1.0, 1.0)

    def close(self) -> None:
        for slot in self._slots:
            for env in slot.values():
                env.close()
        self._slots = []
