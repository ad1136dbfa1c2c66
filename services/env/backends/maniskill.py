"""ManiSkill3 (``mani-skill`` 3.0.1 on SAPIEN 3.0.3 / PhysX) as a backend. Runs in its own environment
(rlfleet.simulators.MANISKILL_ENV: mani-skill, sapien and a CPU torch, plus a Vulkan driver on the host).

- env_id: a registered ManiSkill task id (``PickCube-v1``, ``PushCube-v1``, ``StackCube-v1``,
  ``PegInsertionSide-v1``, ...). Tasks whose assets are not downloaded are refused at once, naming the download
  command (ManiSkill would otherwise ask on stdin). RLinf's ``PutOnPlateInScene25Main-v3`` is rlfleet's own
  implementation (services.env.backends.maniskill_put_on_plate, registered with ManiSkill's registry on import) on
  RLinf's assets (services.env.backends.put_on_plate_assets); its v1/v2 variants are refused with what to do.
- params (``env.*.init_params``):
  ``obs_mode``: ``state`` (default) -> ``{"state": float32 [D]}``; ``rgb`` -> ``{"pixels": uint8 [H, W, 3]`` from
  the task's sensor camera (``camera``, default its first), ``"state": float32 [D]}`` = the agent's proprioception
  and the task's extra state (``agent`` and ``extra`` entries, flattened in ManiSkill's order).
  ``image_size``: ``S`` or ``[H, W]`` (default 64) for the sensor cameras. The Bridge digital twins (Put*InScene*,
  PutOnPlateInScene25Main-v3) render ManiSkill's ``rgb+segmentation`` with their background image at the
  camera's own 640x480, resized to ``image_size`` (area interpolation). ``control_mode``: ManiSkill's
  controller (default: the task's own, ``pd_joint_delta_pos`` for the Panda tasks). ``reward_mode``:
  ``normalized_dense`` (default where the task has it, else the task's own), ``dense``, ``sparse`` or ``none``.
  ``sim_backend``: ``auto`` (default: ``gpu`` when torch sees CUDA, else ``cpu``), ``cpu`` (PhysX CPU: one
  ManiSkill env per slot, as ManiSkill's CPU simulation holds one scene per env) or ``gpu`` (PhysX GPU: ONE
  ManiSkill env batching all ``num_envs`` slots).
  ``env_kwargs``: more keyword arguments for the task's constructor (e.g. ``robot_uids``, ``sim_config``).
- Resets: a seeded reset is ManiSkill's ``reset(seed=s)`` (same seed, same start, on any slot); an unseeded reset
  draws its seed from the slot's generator, itself seeded by the slot's last seed, so runs repeat. No fixed
  initial states (``num_reset_states`` 0), except PutOnPlateInScene25Main-v3, whose episode ids are its fixed
  initial states (RLinf's ``use_fixed_reset_state_ids``). Each reset returns the slot's instruction (the task's
  ``get_language_instruction()`` where it has one: per episode).
- Steps: reward, success (``info["success"]``) and terminated (ManiSkill's own: success or failure) come from
  the task; ManiSkill's time limit is not applied (``max_episode_steps`` of the run config is, by VecEnv; the
  task's own limit is reported as the backend's ``max_episode_steps``).
- Batched GPU simulation (``sim_backend: gpu``) steps every slot at once: a step of some slots steps the others
  with a zero action and then puts their simulation state back (``get_state``/``set_state``), and a reset of some
  slots resets them one by one (a ManiSkill reset seeds one RNG for the whole batch), so per-slot seeds still fix
  each start. Prefer stepping all slots together there (``rollout.pipeline_stage_num: 1``).

The host's side (preflight, importing ManiSkill and making a task without prompts, finishing the environment,
assets) is services.env.backends.maniskill_setup.
"""

from __future__ import annotations

import contextlib

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.wire.spaces import TensorSpace
from services.env.backends.base import BackendUnavailable, SimBackend, StepResult
from services.env.backends.maniskill_setup import enable_gpu_physx, import_maniskill, make_task

INSTRUCTIONS = {  # ManiSkill ships no language; short imperative descriptions of the tabletop tasks
    "PickCube-v1": "pick up the red cube and move it to the goal",
    "PushCube-v1": "push the cube to the red and white target",
    "PullCube-v1": "pull the cube back to the target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PegInsertionSide-v1": "insert the peg into the hole in the box from the side",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PokeCube-v1": "use the peg to poke the cube to the goal",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "push the ball so that it rolls to the goal",
    "PushT-v1": "push the T-shaped block into the target pose",
    "PullCubeTool-v1": "use the tool to pull the cube closer",
    "StackPyramid-v1": "stack the cubes into a pyramid",
    "PlugCharger-v1": "plug the charger into the receptacle",
    "PickSingleYCB-v1": "pick up the object and move it to the goal",
    "PickClutterYCB-v1": "pick up the target object from the clutter and move it to the goal",
    "TurnFaucet-v1": "turn the faucet handle",
    "OpenCabinetDrawer-v1": "open the cabinet drawer",
    "OpenCabinetDoor-v1": "open the cabinet door",
    "PutCarrotOnPlateInScene-v1": "put carrot on plate",
    "PutSpoonOnTableClothInScene-v1": "put the spoon on the towel",
    "StackGreenCubeOnYellowCubeBakedTexInScene-v1": "stack the green block on the yellow block",
    "PutEggplantInBasketScene-v1": "put eggplant into yellow basket",
}
PARAMS = ("obs_mode", "image_size", "camera", "control_mode", "reward_mode", "sim_backend", "env_kwargs")


def instruction_for(env_id: str) -> str:
    if env_id in INSTRUCTIONS:
        return INSTRUCTIONS[env_id]
    import re

    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", env_id.rsplit("-v", 1)[0].replace("_", " "))
    return words.lower()


# --- the backend -----------------------------------------------------------------------------------------------
def _flatten(node, out: list) -> None:
    """ManiSkill's observation dict entries, depth first in its order, as flat float32 rows [B, k]."""
    if isinstance(node, dict):
        for v in node.values():
            _flatten(v, out)
    else:
        t = node.detach().cpu().numpy() if hasattr(node, "detach") else np.asarray(node)
        out.append(t.reshape(t.shape[0], -1).astype(np.float32))


class ManiSkillBackend(SimBackend):
    name = "maniskill"

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        obs_mode: str = "state",
        image_size=64,
        camera: str | None = None,
        control_mode: str | None = None,
        reward_mode: str | None = None,
        sim_backend: str = "auto",
        env_kwargs: dict | None = None,
        **unknown,
    ):
        super().__init__(env_id, num_envs)
        if unknown:
            raise InvalidRequest(f"maniskill: unknown init_params {sorted(unknown)} (known: {', '.join(PARAMS)})")
        if obs_mode not in ("state", "rgb"):
            raise InvalidRequest(f"maniskill: obs_mode must be state or rgb, got {obs_mode!r}")
        size = list(image_size) if isinstance(image_size, (list, tuple)) else [image_size, image_size]
        if len(size) != 2 or not all(8 <= int(s) <= 2048 for s in size):
            raise InvalidRequest(f"maniskill: image_size must be S or [H, W] with sizes in [8, 2048], got {image_size}")
        self.height, self.width = int(size[0]), int(size[1])
        import torch

        backend = {
            "cpu": "physx_cpu",
            "physx_cpu": "physx_cpu",
            "gpu": "physx_cuda",
            "cuda": "physx_cuda",
            "physx_cuda": "physx_cuda",
        }.get(sim_backend)
        if sim_backend == "auto":
            backend = "physx_cuda" if torch.cuda.is_available() else "physx_cpu"
        if backend is None:
            raise InvalidRequest(f"maniskill: sim_backend must be auto, cpu or gpu, got {sim_backend!r}")
        if backend == "physx_cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(
                "maniskill: sim_backend gpu needs a CUDA GPU visible to torch; this process "
                "has none (use sim_backend cpu or auto)"
            )
        self.gpu = backend == "physx_cuda"
        if self.gpu:
            enable_gpu_physx()
        self.obs_mode, self.camera = obs_mode, camera
        self._torch = torch
        kwargs = dict(env_kwargs or {})
        spec = import_maniskill().get(env_id)
        if reward_mode is None:  # normalized_dense where the task has it (most do), else the task's own default
            modes = getattr(spec.cls, "SUPPORTED_REWARD_MODES", ()) if spec else ()
            reward_mode = "normalized_dense" if not modes or "normalized_dense" in modes else modes[0]
        obs_modes = getattr(spec.cls, "SUPPORTED_OBS_MODES", ()) if spec else ()
        # the Bridge digital twins: rgb with their greenscreen background, at their camera's own size
        self.resize = obs_mode == "rgb" and "rgb" not in obs_modes and "rgb+segmentation" in obs_modes
        kwargs.update(
            obs_mode="rgb+segmentation" if self.resize else obs_mode,
            reward_mode=reward_mode,
            sim_backend=backend,
            render_mode=None,
            num_envs=num_envs if self.gpu else 1,
        )
        if control_mode is not None:
            kwargs["control_mode"] = control_mode
        if obs_mode == "rgb" and not self.resize:
            kwargs["sensor_configs"] = {**kwargs.get("sensor_configs", {}), "width": self.width, "height": self.height}
        # a renderer even for state observations: some tasks (PushT) build render shapes; SAPIEN needs Vulkan anyway
        kwargs.setdefault("render_backend", "gpu" if self.gpu else "cpu")
        self.envs = []
        try:
            for _ in range(1 if self.gpu else num_envs):
                self.envs.append(make_task(env_id, **kwargs))
        except Exception:
            self.close()
            raise
        env = self.envs[0]
        if not hasattr(env.single_action_space, "shape") or env.single_action_space.shape is None:
            self.close()
            raise InvalidRequest(
                f"maniskill: {env_id} has a {type(env.single_action_space).__name__} action space "
                f"(several agents); this backend drives tasks with one Box action"
            )
        self.control_mode = env.control_mode
        from mani_skill.utils.registration import REGISTERED_ENVS

        self.instruction = instruction_for(env_id)
        self._per_episode_text = callable(getattr(env.unwrapped, "get_language_instruction", None))
        first = self._rows(env._init_raw_obs if hasattr(env, "_init_raw_obs") else env.reset(seed=0)[0])
        obs_space = {"state": TensorSpace((first["state"].shape[1],), np.float32)}
        if obs_mode == "rgb":
            obs_space["pixels"] = TensorSpace((self.height, self.width, 3), np.uint8, 0, 255)
        self.observation_space = obs_space
        self.action_space = TensorSpace.from_gym(env.single_action_space)
        self.max_episode_steps = int(REGISTERED_ENVS[env_id].max_episode_steps or 1000)
        # tasks with enumerated episodes (PutOnPlateInScene25Main-v3's episode ids) offer them as fixed states
        self.num_reset_states = int(getattr(env.unwrapped, "total_num_trials", 0) or 0)
        self._rngs = [np.random.default_rng(i) for i in range(num_envs)]

    # --- observations -------------------------------------------------------------------------------------
    def _rows(self, obs) -> dict[str, np.ndarray]:
        """One ManiSkill observation (a batch of B envs) -> {"state": [B, D], "pixels": [B, H, W, 3]}."""
        if self.obs_mode == "state":
            return {"state": obs.detach().cpu().numpy().astype(np.float32).reshape(obs.shape[0], -1)}
        parts: list[np.ndarray] = []
        for key in ("agent", "extra"):
            if key in obs:
                _flatten(obs[key], parts)
        sensors = obs["sensor_data"]
        name = self.camera or next(iter(sensors))
        if name not in sensors:
            raise InvalidRequest(f"maniskill: {self.env_id} has no camera {name!r} (cameras: {', '.join(sensors)})")
        rgb = sensors[name]["rgb"].detach().cpu().numpy()[..., :3]
        if rgb.shape[1:3] != (self.height, self.width):
            import cv2

            rgb = np.stack(
                [
                    cv2.resize(
                        np.ascontiguousarray(im, dtype=np.uint8),
                        (self.width, self.height),
                        interpolation=cv2.INTER_AREA,
                    )
                    for im in rgb
                ]
            )
        batch = rgb.shape[0]
        state = np.concatenate(parts, axis=1) if parts else np.zeros((batch, 0), np.float32)
        return {"state": state, "pixels": np.ascontiguousarray(rgb, dtype=np.uint8)}

    # --- reset and step -----------------------------------------------------------------------------------
    def _seed(self, slot: int, seed: int | None) -> int:
        if seed is not None:
            self._rngs[slot] = np.random.default_rng(int(seed))
            return int(seed) % (2**31)
        return int(self._rngs[slot].integers(2**31))

    def _text(self, slot: int) -> str:
        if not self._per_episode_text:
            return self.instruction
        env = self.envs[0] if self.gpu else self.envs[slot]
        texts = env.unwrapped.get_language_instruction()
        return str(texts[slot if self.gpu else 0])

    def reset(self, env_ids, seeds, state_ids):
        if any(s is not None for s in state_ids) and not self.num_reset_states:
            raise InvalidRequest("maniskill: no fixed initial states (num_reset_states is 0)")
        rows, texts = [], []
        for i, seed, state in zip(env_ids, seeds, state_ids):
            s = self._seed(int(i), seed)
            options = {} if state is None else {"episode_id": int(state)}
            if self.gpu:  # one slot at a time: a batched reset seeds one RNG for all the slots it resets
                idx = self._torch.tensor([int(i)], device=self.envs[0].device)
                obs, _ = self.envs[0].reset(seed=[s], options={"env_idx": idx, **options})
                row = {k: v[int(i) : int(i) + 1] for k, v in self._rows(obs).items()}
            else:
                obs, _ = self.envs[int(i)].reset(seed=s, options=options)
                row = self._rows(obs)
            rows.append(row)
            texts.append(self._text(int(i)))
        out = {k: np.concatenate([r[k] for r in rows]) for k in self.observation_space}
        return out, texts

    def drawn_state_ids(self, env_ids):
        if not self.num_reset_states:
            return [None] * len(env_ids)
        if self.gpu:
            return [int(self.envs[0].unwrapped.episode_ids[int(i)]) for i in env_ids]
        return [int(self.envs[int(i)].unwrapped.episode_ids[0]) for i in env_ids]

    def step(self, env_ids, actions) -> StepResult:
        if self.gpu:
            return self._step_batched(np.asarray(env_ids), actions)
        n = len(env_ids)
        rows, rewards = [], np.zeros(n, np.float32)
        terminated, success = np.zeros(n, bool), np.zeros(n, bool)
        for j, i in enumerate(env_ids):
            obs, reward, term, _, info = self.envs[int(i)].step(self._torch.from_numpy(np.asarray(actions[j])))
            rows.append(self._rows(obs))
            rewards[j], terminated[j] = float(reward.reshape(-1)[0]), bool(term.reshape(-1)[0])
            if "success" in info:
                success[j] = bool(info["success"].reshape(-1)[0])
        obs = {k: np.concatenate([r[k] for r in rows]) for k in self.observation_space}
        return StepResult(obs, rewards, terminated, np.zeros(n, bool), success)

    def _step_batched(self, env_ids: np.ndarray, actions) -> StepResult:
        torch, env = self._torch, self.envs[0]
        full = np.zeros((self.num_envs, *self.action_space.shape), np.float32)
        full[env_ids] = actions
        others = np.setdiff1d(np.arange(self.num_envs), env_ids)
        saved = env.get_state() if len(others) else None  # the slots not stepped keep their simulation state
        obs, reward, term, _, info = env.step(torch.from_numpy(full).to(env.device))
        if saved is not None:
            idx = torch.from_numpy(others).to(env.device)
            env.set_state(saved[idx], env_idx=idx)
            env._elapsed_steps[idx] -= 1
        rows = self._rows(obs)
        obs_rows = {k: v[env_ids] for k, v in rows.items()}
        reward = reward.detach().cpu().numpy().reshape(-1)[env_ids].astype(np.float32)
        term = term.detach().cpu().numpy().reshape(-1)[env_ids].astype(bool)
        success = (
            info["success"].detach().cpu().numpy().reshape(-1)[env_ids].astype(bool)
            if "success" in info
            else np.zeros(len(env_ids), bool)
        )
        return StepResult(obs_rows, reward, term, np.zeros(len(env_ids), bool), success)

    def close(self) -> None:
        for env in getattr(self, "envs", []):
            with contextlib.suppress(Exception):
                env.close()
        self.envs = []
